"""Aggregate engine steps per instance x minute x batch bucket x N.

The tuner's cost model needs decode step time as a function of batch size and N
(steps that also prefill, or where only some requests verified drafts, are left out: they
measure the prompt or a partial N, not N);
per-step rows would be ~100/s per instance, so steps are folded into one row
per key and minute, with the sum, p50 and p95 of step time.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from spectune.engine.schema import StepRecord


def add_positions(total: list[int], values: Sequence[int]) -> list[int]:
    """Element-wise ``total += values`` for per-position counts (``total`` grows as needed)."""
    total += [0] * (len(values) - len(total))
    for i, v in enumerate(values):
        total[i] += v
    return total


def batch_bucket(batch_size: int) -> int:
    """Smallest power of two >= batch size: 1, 2, 4, 8, ... (bucket 4 = sizes 3-4)."""
    return 1 << max(0, batch_size - 1).bit_length()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass
class _Acc:
    times: list[float] = field(default_factory=list)
    batch_sum: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class StepAggregator:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int, int, int], _Acc] = defaultdict(_Acc)

    def add(self, step: StepRecord) -> None:
        if step.num_prefill_requests:
            # A step that also prefills costs what the prompts cost, whatever N is; with speculation on,
            # every request's prefill step verifies nothing and would pass for an N=0 step, making plain
            # decoding look slow. Step statistics describe decode steps only.
            return
        if 0 < step.num_drafts < step.num_decode_requests:
            # Only some requests verified drafts (a probe in an off class, a mixed-class batch): the step
            # costs less than N for everyone and more than N=0, so it would flatter N. Left out too.
            return
        key = (step.instance_id, int(step.time // 60) * 60, batch_bucket(step.batch_size), step.num_speculative_tokens)
        with self._lock:
            acc = self._open[key]
            acc.times.append(step.step_time_s)
            acc.batch_sum += step.batch_size
            acc.tokens += step.num_scheduled_tokens
            acc.drafted += step.num_draft_tokens
            acc.accepted += step.num_accepted_tokens
            add_positions(acc.accepted_per_position, step.accepted_per_position)

    def flush(self, final: bool = False, now: float | None = None) -> list[dict]:
        """Rows for minutes that have closed (all of them when ``final``)."""
        current = int((now if now is not None else time.time()) // 60) * 60
        with self._lock:
            keys = [k for k in self._open if final or k[1] < current]
            closed = [(k, self._open.pop(k)) for k in keys]
        rows = []
        for (instance, minute, bucket, n), acc in closed:
            times = sorted(acc.times)
            rows.append(
                dict(
                    instance_id=instance,
                    minute=float(minute),
                    batch_bucket=bucket,
                    num_speculative_tokens=n,
                    steps=len(times),
                    step_time_sum_s=sum(times),
                    step_time_p50_s=percentile(times, 0.5),
                    step_time_p95_s=percentile(times, 0.95),
                    batch_size_sum=acc.batch_sum,
                    scheduled_tokens=acc.tokens,
                    num_draft_tokens=acc.drafted,
                    num_accepted_tokens=acc.accepted,
                    accepted_per_position=acc.accepted_per_position,
                )
            )
        return rows
