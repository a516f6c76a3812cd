"""Runtime control of N inside vLLM's engine-core process.

vLLM has no API to change the speculation length while serving, but its
scheduler already picks the number of draft tokens per step from a dense
``batch_size -> K`` lookup (``num_speculative_tokens_per_batch_size``).  This
subclass recomputes that lookup from ``RuntimeSettings`` and trims each
request's drafts to the N of its prompt class, so:

* N, on/off and the batch-size table change at the next engine step;
* when every running class resolves to N=0 the drafter is not run at all
  (the same path vLLM takes for a K=0 batch size), so "off" costs no drafting;
* requests keep their place: nothing is drained, restarted or failed.

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

from .schema import RuntimeSettings

CLASS_ARG = "spectune_class"
PROBE_ARG = "spectune_probe"
DEFAULT_CLASS = "default"


def _request_tag(request: Any) -> tuple[str, bool]:
    """(prompt class, is a probe) from the request's sampling extra_args."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(CLASS_ARG, DEFAULT_CLASS), bool(extra.get(PROBE_ARG, False))


class SpectuneScheduler(Scheduler):
    """vLLM scheduler whose speculation length follows ``RuntimeSettings``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spectune_settings = RuntimeSettings(num_speculative_tokens=self.num_spec_tokens)
        self._lookup_key: tuple[int, frozenset[tuple[str, bool]]] | None = None
        self._last_batch_size = 1

    # -- control -------------------------------------------------------------
    def apply_settings(self, settings: RuntimeSettings) -> None:
        self.spectune_settings = settings
        self._lookup_key = None
        # Drafts already proposed under the old settings would be verified at
        # the next step; trim them so the change holds from that step on.
        self._trim_drafts(r.request_id for r in self.running)

    # -- hooks into vLLM ---------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        if self.num_spec_tokens > 0:
            self._refresh_lookup()
        output = super().schedule(*args, **kwargs)
        self._last_batch_size = max(1, len(output.num_scheduled_tokens))
        return output

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:  # type: ignore[override]
        super().update_draft_token_ids(draft_token_ids)
        self._trim_drafts(draft_token_ids.req_ids)

    # -- internals -----------------------------------------------------------
    def _trim_drafts(self, request_ids: Any) -> None:
        if self.num_spec_tokens == 0:
            return
        settings, batch = self.spectune_settings, self._last_batch_size
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or not request.spec_token_ids:
                continue
            prompt_class, probe = _request_tag(request)
            limit = settings.n_for(prompt_class, batch, self.num_spec_tokens, probing=probe)
            if len(request.spec_token_ids) > limit:
                request.spec_token_ids = request.spec_token_ids[:limit]

    def _refresh_lookup(self) -> None:
        classes = frozenset(_request_tag(r) for r in self.running) | frozenset(_request_tag(r) for r in self.waiting)
        key = (self.spectune_settings.version, classes)
        if key == self._lookup_key:
            return
        settings, cap = self.spectune_settings, self.num_spec_tokens
        active = classes or frozenset({(DEFAULT_CLASS, False)})
        # Index 0 unused: vLLM indexes the lookup by batch size directly.
        self.dynamic_sd_lookup = [0] + [
            max(settings.n_for(c, b, cap, probing=probe) for c, probe in active)
            for b in range(1, self.max_num_running_reqs + 1)
        ]
        self._lookup_key = key


def _spectune_apply(self: EngineCore, settings: dict[str, Any]) -> int:
    """Engine-core utility: install new settings, return the version held."""
    scheduler = self.scheduler
    if not isinstance(scheduler, SpectuneScheduler):
        raise RuntimeError("spectune_apply needs the SpectuneScheduler")
    parsed = RuntimeSettings.model_validate(settings)
    scheduler.apply_settings(parsed)
    return parsed.version


# vLLM dispatches utility calls by attribute name on the EngineCore object.
EngineCore.spectune_apply = _spectune_apply  # type: ignore[attr-defined]
