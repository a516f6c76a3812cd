"""What one tuner run reads from the store, read once and shared by every class's decision."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine

from spectune.store import tuner_inputs as inputs
from spectune.store.aggregates import ArmLatency, latency_by_arm

from .cost import PrefillCost
from .decide import MIN_LATENCY_REQUESTS, Measured
from .goodput import busiest_bucket
from .paired_cost import RatioEstimate, paired_ratios, paired_speedup

Counts = dict[str, tuple[list[int], list[int]]]  # class -> (drafted, accepted) per position
Latency = dict[str, dict[bool, ArmLatency]]  # class -> {speculating: its requests' latency}


@dataclass
class RunReads:
    """What one tuner run reads from the store (the history only when a class needs it)."""

    window: Counts
    recent: Counts
    history: Callable[[], Counts]
    times: dict[int, dict[int, float]]
    counts: dict[int, dict[int, int]]
    prefill: dict[int, PrefillCost]
    steps: dict[int, int]
    busiest: int | None
    drafting: dict[int, dict[int, float]]  # share of requests that drafted, per bucket and N
    paired: dict[int, dict[int, RatioEstimate]]  # t(N) / t(0) from paired minutes, per bucket and N
    measured: Measured  # tokens/s at N over plain tokens/s from paired minutes, per bucket and N
    latency: Callable[[str], dict[bool, ArmLatency]]  # read only where a class has a TTFT budget (``_latency``)


def _prefill(rows: list[inputs.StepMinute], since: datetime, until: datetime) -> dict[int, PrefillCost]:
    return {b: PrefillCost(**entry) for b, entry in inputs.prefill_of(rows, since, until).items()}


def _latency(prompt_class: str, recent: Callable[[], Latency], longer: Callable[[], Latency]) -> dict[bool, ArmLatency]:
    """A class's latency per arm over the window (``recent``); where its speculating requests there
    are too few to say (an off class: only its probes draft; a quiet one: none), both arms from
    ``longer`` instead -- since the draft in force came in, at most the cost window: the speculation
    that broke a budget keeps the class off until enough requests since say otherwise."""
    arms = recent().get(prompt_class, {})
    if arms.get(True) is not None and arms[True].requests >= MIN_LATENCY_REQUESTS:
        return arms
    return longer().get(prompt_class, arms)


def read_run(
    db: Engine, now: datetime, since: datetime, *, window: timedelta, interval: timedelta, cost_window: timedelta
) -> RunReads:
    """The run's inputs.  The hour of acceptance history (read when the window holds too few
    drafts) and the steps that drafted start at ``since``, when the draft in force came in:
    another draft's say nothing about this one.  The window and the last interval are read as
    they are -- right after a swap the last interval shows the change (``acceptance_shifted``),
    and the records a draining engine finishes after the policy write are still the old draft's."""
    minutes = [m for m in inputs.step_minutes(db, now - cost_window, now) if m.n == 0 or m.minute >= since]
    times, counts = inputs.times_of(minutes, now - cost_window, now)
    steps = {b: sum(per.values()) for b, per in counts.items()}
    _, recent_counts = inputs.times_of(minutes, now - window, now)
    traffic = recent_counts or counts
    return RunReads(
        window=inputs.acceptance_counts(db, now - window, now),
        recent=inputs.acceptance_counts(db, now - interval, now),
        history=functools.cache(lambda: inputs.acceptance_counts(db, max(now - cost_window, since), now)),
        times=times,
        counts=counts,
        prefill=_prefill(minutes, now - cost_window, now),
        steps=steps,
        busiest=busiest_bucket(traffic),
        drafting=inputs.drafting_share_of(minutes, now - window, now),
        paired=paired_ratios(inputs.paired_of(minutes, now - cost_window, now)),
        measured=paired_ratios(inputs.paired_throughput_of(minutes, now - cost_window, now), paired_speedup),
        latency=functools.partial(
            _latency,
            recent=functools.cache(lambda: latency_by_arm(db, now - window, now)),
            longer=functools.cache(lambda: latency_by_arm(db, max(now - cost_window, since), now)),
        ),
    )
