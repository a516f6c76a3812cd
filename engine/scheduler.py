"""Runtime control of N inside vLLM's engine-core process.

vLLM has no API to change the speculation length while serving, but its
scheduler output already carries the number of draft tokens to propose after
each step (``num_spec_tokens_to_schedule``, which vLLM's own dynamic
speculation fills from a ``batch_size -> K`` lookup).  This subclass sets it
from ``RuntimeSettings`` after every ``schedule()`` and trims each request's
drafts to the N of its prompt class, so:

* N, on/off and the batch-size table change at the next engine step;
* K for a step is decided after scheduling, as the largest N among the
  scheduled requests that may still speculate; at K=0 the draft model does not
  run at all (``engine/drafter.py``), so "off" costs what plain decoding costs;
* a request scheduled in a step where the drafter did not run has stale draft
  KV (the skipped positions are missing from the draft cache), so it never
  gets drafts again: speculation can be demoted per request, never promoted
  back.  Requests admitted later speculate with a complete draft cache;
* requests keep their place: nothing is drained, restarted or failed;
* a request with stop strings carries its acceptance counts on every output,
  not only on its last: vLLM stops those requests in the front-end (the
  detokenizer sees the string), where engine core never sends its final
  counts, so a record of a stopped request would say nothing was drafted.

Settings arrive through an engine-core *utility call* (``spectune_apply``),
the same request/response channel vLLM uses for ``reset_prefix_cache`` and
friends, so ``SpecEngine.apply`` returns only after the scheduler holds them.

This module is imported in the engine-core process by vLLM
(``scheduler_cls="spectune.engine.scheduler.SpectuneScheduler"``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

from . import drafter, faults
from .drafter import UnsupportedVllmError
from .schema import CLASS_ARG, PLAIN_ARG, PROBE_ARG, RuntimeSettings

TOKEN_PROPOSERS = frozenset({"ngram", "ngram_gpu", "suffix"})


def _request_tag(request: Any) -> tuple[str | None, bool, bool]:
    """(prompt class, is a probe, runs plain) from the request's sampling extra_args; the class is
    None for a request the engine did not tag (it runs the global settings)."""
    params = request.sampling_params  # None for pooling requests
    extra = (params.extra_args if params is not None else None) or {}
    return extra.get(CLASS_ARG), bool(extra.get(PROBE_ARG, False)), bool(extra.get(PLAIN_ARG, False))


def check_supported(scheduler: Scheduler) -> None:
    """Fail unless the scheduler internals the hook relies on exist at this vLLM version."""
    missing = [
        name
        for name in (
            "dynamic_sd_lookup",
            "num_spec_tokens",
            "vllm_config",
            "requests",
            "running",
            "waiting",
            "max_num_running_reqs",
            "spec_decode_metrics_level",
        )
        if not hasattr(scheduler, name)
    ]
    for method in ("update_draft_token_ids", "update_from_output"):
        if not callable(getattr(Scheduler, method, None)):
            missing.append(f"{method}()")
    if missing:
        raise UnsupportedVllmError(f"SpectuneScheduler: vLLM's Scheduler has no {', '.join(missing)}")


class SpectuneScheduler(Scheduler):
    """vLLM scheduler whose speculation length follows ``RuntimeSettings``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_supported(self)
        self.spectune_settings = RuntimeSettings(num_speculative_tokens=self.num_spec_tokens)
        if self.num_spec_tokens > 0:
            # Any lookup keeps vLLM from padding decodes to K drafts; its value per batch size is
            # unused, since schedule() sets each step's K itself (the sync scheduler reads it nowhere).
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.max_num_running_reqs + 1)
        self._last_batch_size = 1
        # Requests whose draft KV misses positions (scheduled in a step the drafter skipped).
        # Token-level proposers (ngram, suffix) keep no KV: nothing goes stale.
        self.stale_draft: set[str] = set()
        spec = self.vllm_config.speculative_config
        self._drafter_keeps_kv = spec is not None and spec.method not in TOKEN_PROPOSERS

    # -- control -------------------------------------------------------------
    def apply_settings(self, settings: RuntimeSettings) -> None:
        self.spectune_settings = settings
        # Drafts already proposed under the old settings would be verified at
        # the next step; trim them so the change holds from that step on.
        self._trim_drafts(r.request_id for r in self.running)

    # -- hooks into vLLM ---------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        output = super().schedule(*args, **kwargs)
        scheduled = output.num_scheduled_tokens
        self._last_batch_size = max(1, len(scheduled))
        if self.num_spec_tokens > 0 and scheduled:
            output.num_spec_tokens_to_schedule = self._step_k(scheduled)
            if output.num_spec_tokens_to_schedule == 0 and self._drafter_keeps_kv:
                # The drafter will not run this step: these requests' draft KV goes stale.
                self.stale_draft.update(scheduled)
            self.stale_draft.intersection_update(self.requests)
        return output

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:  # type: ignore[override]
        super().update_draft_token_ids(draft_token_ids)
        self._trim_drafts(draft_token_ids.req_ids)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):  # type: ignore[override]
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.spec_decode_metrics_level != "none":
            for batch in outputs.values():
                for out in batch.outputs:
                    if out.spec_decode_metrics is None and out.finish_reason is None:
                        request = self.requests.get(out.request_id)
                        if request is not None and request.sampling_params and request.sampling_params.stop:
                            out.spec_decode_metrics = request.spec_decode_metrics  # the front-end may stop it
        return outputs

    # -- internals -----------------------------------------------------------
    def _request_n(self, req_id: str, batch: int) -> int:
        """N this request may draft at this batch size (0 once its draft KV is stale)."""
        request = self.requests.get(req_id)
        if request is None or req_id in self.stale_draft:
            return 0
        prompt_class, probe, plain = _request_tag(request)
        if plain:
            return 0
        return self.spectune_settings.n_for(prompt_class, batch, self.num_spec_tokens, probing=probe)

    def _step_k(self, scheduled: dict[str, int]) -> int:
        """Drafts to propose after this step: the largest N among the scheduled requests."""
        batch = len(scheduled)
        return max((self._request_n(req_id, batch) for req_id in scheduled), default=0)

    def _trim_drafts(self, request_ids: Any) -> None:
        if self.num_spec_tokens == 0:
            return
        batch = self._last_batch_size
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or not request.spec_token_ids:
                continue
            limit = self._request_n(req_id, batch)
            if len(request.spec_token_ids) > limit:
                request.spec_token_ids = request.spec_token_ids[:limit]


def _spectune_apply(self: EngineCore, settings: dict[str, Any]) -> int:
    """Engine-core utility: install new settings, return the version held."""
    scheduler = self.scheduler
    if not isinstance(scheduler, SpectuneScheduler):
        raise RuntimeError("spectune_apply needs the SpectuneScheduler")
    parsed = RuntimeSettings.model_validate(settings)
    scheduler.apply_settings(parsed)
    return parsed.version


# Functions run in every worker, by name (the executor pickles them when workers are processes).
WORKER_CALLS = {
    "install_free_off_state": drafter.install_in_worker,
    "count_draft_forwards": drafter.count_draft_forwards,
    "install_test_fault": faults.install_in_worker,
}


def _spectune_worker_call(self: EngineCore, name: str) -> list[Any]:
    """Engine-core utility: run one of ``WORKER_CALLS`` in every worker."""
    return self.model_executor.collective_rpc(WORKER_CALLS[name])


# vLLM dispatches utility calls by attribute name on the EngineCore object.
EngineCore.spectune_apply = _spectune_apply  # type: ignore[attr-defined]
EngineCore.spectune_worker_call = _spectune_worker_call  # type: ignore[attr-defined]
