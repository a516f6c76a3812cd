"""Per-step statistics from vLLM's stat-logger hook.

vLLM calls every stat logger once per engine step with ``SchedulerStats``
(batch composition, step time via ``iteration_details``, spec-decode counts).
``StepStatsLogger`` turns that into a ``StepRecord`` and hands it to a
callback; ``BatchAccountant`` attributes each step's batch size to the
requests that were decoding in it (a running request is in every decode step
until it finishes, so the steps between its first token and its end are its
batches).

PromQL for the vLLM counters these steps mirror:
    acceptance rate   = rate(vllm:spec_decode_num_accepted_tokens_total[5m])
                        / rate(vllm:spec_decode_num_draft_tokens_total[5m])
    acceptance length = 1 + rate(vllm:spec_decode_num_accepted_tokens_total[5m])
                        / rate(vllm:spec_decode_num_drafts_total[5m])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from .drafter import UnsupportedVllmError
from .schema import StepRecord

# The fields of vLLM's stats and outputs that step and request records read (here and in
# ``telemetry.py``): checked at start-up (``check_supported``) so a renamed field fails the start
# instead of turning into zeros in every record.
FIELDS_READ = {
    "vllm.v1.metrics.stats.SchedulerStats": {"num_running_reqs", "iteration_details", "spec_decoding_stats"},
    "vllm.v1.metrics.stats.SchedulerIterationDetails": {
        "num_ctx_requests",
        "num_ctx_tokens",
        "num_generation_requests",
        "num_generation_tokens",
        "elapsed_ms",
    },
    "vllm.v1.spec_decode.metrics.SpecDecodingStats": {
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_draft_tokens_per_pos",
        "num_accepted_tokens_per_pos",
    },
    "vllm.outputs.CompletionOutput": {"index", "text", "token_ids", "finish_reason", "spec_decode_metrics"},
    "vllm.v1.metrics.stats.RequestStateStats": {"arrival_time", "first_token_latency"},
    "vllm.v1.metrics.stats.RequestSpecDecodeMetrics": {"per_step_accepted", "per_step_drafted", "num_draft_tokens"},
}


def check_supported() -> None:
    import dataclasses
    import importlib

    missing = []
    for path, fields in FIELDS_READ.items():
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None)
        present = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        missing += [f"{name}.{field}" for field in sorted(fields - present)]
    if missing:
        raise UnsupportedVllmError(f"vLLM's statistics and outputs lack {', '.join(missing)}: records would be wrong")


def step_record(instance_id: str, scheduler_stats: Any, now: float, last: float) -> StepRecord:
    """Build a StepRecord from vLLM's SchedulerStats (pure).  Both parts are optional in vLLM:
    iteration details only when asked for, spec-decode stats only in steps that speculated.

    The step's time is the wall time since the previous step's statistics (``now - last``) when
    the step decodes requests that ran before it (the engine was busy all along): vLLM's own step
    timer leaves out the engine's work between steps, which speculation makes dearer (measured
    here at batch 8: 17 ms per step plain, 51 ms at N = 3), and clients wait for it.  Summed over
    steps these intervals are the busy wall time exactly, however the outputs bunch up on their
    way.  Otherwise (a prompt-only step after idling) vLLM's timer."""
    details = scheduler_stats.iteration_details
    spec = scheduler_stats.spec_decoding_stats
    if details is not None:
        prefill, decode = details.num_ctx_requests, details.num_generation_requests
        tokens = details.num_ctx_tokens + details.num_generation_tokens
        step_time = max(0.0, now - last) if decode else details.elapsed_ms / 1000.0
    else:
        prefill, decode = 0, scheduler_stats.num_running_reqs
        tokens, step_time = decode, max(0.0, now - last)
    drafted_per_pos = list(spec.num_draft_tokens_per_pos) if spec is not None else []
    return StepRecord(
        instance_id=instance_id,
        time=now,
        batch_size=prefill + decode,
        num_prefill_requests=prefill,
        num_decode_requests=decode,
        num_scheduled_tokens=tokens,
        step_time_s=step_time,
        num_speculative_tokens=sum(1 for d in drafted_per_pos if d > 0),
        num_drafts=spec.num_drafts if spec is not None else 0,
        num_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        num_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        accepted_per_position=list(spec.num_accepted_tokens_per_pos) if spec is not None else [],
    )


def make_stat_logger(instance_id: str, on_step: Callable[[StepRecord], None]) -> type:
    """A vLLM stat-logger class bound to one engine instance and callback."""

    class StepStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._last = time.time()

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            if scheduler_stats is None:
                return
            now = time.time()
            record = step_record(instance_id, scheduler_stats, now, self._last)
            self._last = now
            if record.batch_size:
                on_step(record)

        def log_engine_initialized(self) -> None:
            pass

    return StepStatsLogger


@dataclass
class _Batches:
    steps: int = 0
    total: int = 0
    largest: int = 0


@dataclass
class BatchAccountant:
    """Batch sizes each in-flight request has run in (mean and max)."""

    _decoding: dict[str, _Batches] = field(default_factory=dict)

    def start(self, request_id: str) -> None:
        self._decoding[request_id] = _Batches()

    def observe(self, step: StepRecord) -> None:
        for batches in self._decoding.values():
            batches.steps += 1
            batches.total += step.batch_size
            batches.largest = max(batches.largest, step.batch_size)

    def finish(self, request_id: str) -> tuple[float | None, int | None]:
        batches = self._decoding.pop(request_id, None)
        if batches is None or not batches.steps:
            return None, None
        return batches.total / batches.steps, batches.largest
