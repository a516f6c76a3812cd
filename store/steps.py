"""Aggregate engine steps per instance x minute x batch bucket x N.

The tuner's cost model needs decode step time as a function of batch size and N
(steps where only some requests verified drafts are left out: they measure a partial N),
and what prompts cost on top: steps that also prefill are counted apart (count, time,
tokens generated), not in the step times, since they measure the prompt, not N;
per-step rows would be ~100/s per instance, so steps are folded into one row
per key and minute, with the sum, p50 and p95 of step time.

The open minute is not kept from the tuner until it closes: ``flush(snapshot_open=True)`` also
returns the running totals of open keys that changed, and the store replaces a key's row with
the newer totals (``upsert_step_stats``), so a cost probe is visible seconds after it ran.
"""

from __future__ import annotations

import copy
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
    # Steps that also prefilled: what prompts cost on top of decoding (the drafter prefills too
    # where speculation is on), which the tuner charges per generated token.
    prefill_steps: int = 0
    prefill_time: float = 0.0
    prefill_generated: int = 0


class StepAggregator:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int, int, int], _Acc] = defaultdict(_Acc)
        self._changed: set[tuple[str, int, int, int]] = set()  # open keys with steps since their last row
        self._last_n: dict[str, int] = {}  # per instance: N of its last decode step

    def add(self, step: StepRecord) -> None:
        # A step where only some requests verified drafts (the others demoted, or of a class at a lower
        # N) counts under its N: the drafter ran over the whole batch, and such steps are what serving
        # at that N costs and yields (left out, they made N look 1.35x at batch 8 where it ran 0.91x).
        with self._lock:
            if step.num_prefill_requests:
                # A step that also prefills costs what the prompts cost: kept apart from the decode step
                # times. A prefill-only step verifies nothing, so it would pass for N=0 with speculation
                # on; it counts under the N of the instance's last decode step (on or off is what matters).
                n = step.num_speculative_tokens or self._last_n.get(step.instance_id, 0)
                acc = self._open[self._key(step, n)]
                acc.prefill_steps += 1
                acc.prefill_time += step.step_time_s
                acc.prefill_generated += step.num_decode_requests + step.num_accepted_tokens
                self._changed.add(self._key(step, n))
                return
            self._last_n[step.instance_id] = step.num_speculative_tokens
            key = self._key(step, step.num_speculative_tokens)
            acc = self._open[key]
            self._changed.add(key)
            acc.times.append(step.step_time_s)
            acc.batch_sum += step.batch_size
            acc.tokens += step.num_scheduled_tokens
            acc.drafted += step.num_draft_tokens
            acc.accepted += step.num_accepted_tokens
            add_positions(acc.accepted_per_position, step.accepted_per_position)

    @staticmethod
    def _key(step: StepRecord, n: int) -> tuple[str, int, int, int]:
        return (step.instance_id, int(step.time // 60) * 60, batch_bucket(step.batch_size), n)

    def flush(self, final: bool = False, now: float | None = None, snapshot_open: bool = False) -> list[dict]:
        """Rows for minutes that have closed (all of them when ``final``) and, with ``snapshot_open``,
        the running totals so far of open minutes that gained steps since their last row."""
        current = int((now if now is not None else time.time()) // 60) * 60
        with self._lock:
            keys = [k for k in self._open if final or k[1] < current]
            closed = [(k, self._open.pop(k)) for k in keys]
            # A closed key without new steps already went out, final, as its last snapshot.
            emitted = [(k, acc) for k, acc in closed if k in self._changed]
            self._changed.difference_update(keys)
            if snapshot_open:
                emitted += [(k, copy.deepcopy(self._open[k])) for k in self._changed]  # rows built unlocked
                self._changed.clear()
        rows = []
        for (instance, minute, bucket, n), acc in emitted:
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
                    prefill_steps=acc.prefill_steps,
                    prefill_time_sum_s=acc.prefill_time,
                    prefill_generated_tokens=acc.prefill_generated,
                )
            )
        return rows
