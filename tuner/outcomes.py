"""What a decision's setting delivered against plain serving: its realised speedup (pure).

A decision's setting is in force from the decision until the class's next applied change (a
``keep`` row continues the setting before it).  Its realised speedup is what serving at its N at
its busiest bucket delivered over that span, as tokens/s against plain tokens/s, every step counted
(prompts' steps included), measured one of two ways (the decision row's ``realised_estimator``):

- ``paired``: ``paired_cost.paired_speedup`` over the span's paired minutes -- plain steps (control
  requests, cost probes, probes) and steps at N in the same minute of one instance -- so the
  machine's minute-to-minute drift cancels; with its 90 % interval and the minutes it counted.
- ``unpaired``: tokens/s at N over the span against plain steps' tokens/s over the last cost window
  (``goodput.measured_speedups``); drift between those minutes does not cancel, no interval.  The
  fallback, for decisions whose span held too few paired minutes (no control budget, no probe).

When: a span that is still in force closes once it is ``settle`` long and holds
``MIN_PAIRED_MINUTES`` paired minutes; without them it waits ``patience`` for some (a control
request may yet come) before it closes unpaired.  A span that ended closes at once: it will get no
more minutes.  Steps are per batch bucket, not per class: classes that share a bucket and an N share
its measurement.

Latency counts too: ``latency`` sets a decision's time to first token and per output token
against plain requests of its class at its bucket over the same span (control requests where it
spoke; none at larger batches, where control requests are not drawn).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from spectune.store.aggregates import ArmLatency
from spectune.store.tuner_inputs import Realised, StepMinute, paired_throughput_of, throughput_of

from .goodput import measured_speedups
from .paired_cost import paired_speedup

LANDED = timedelta(minutes=1)  # the minute a span ends in still holds its steps


def realised(
    minutes: list[StepMinute],
    at: datetime,
    bucket: int,
    n: int,
    changed: datetime | None,
    now: datetime,
    plain: dict[int, dict[int, tuple]],
    settle: timedelta,
    patience: timedelta,
) -> Realised | None:
    """The realised speedup of a decision taken ``at``, for N=``n`` at ``bucket``, whose setting was
    replaced at ``changed`` (None: still in force at ``now``), or None while it cannot be said yet.
    ``minutes``: the step minutes over the span; ``plain``: ``throughput_of`` the last cost window
    (the unpaired fallback's plain side)."""
    ended = changed is not None
    until = (changed if ended else now) + LANDED
    if not ended and now - at < settle:
        return None
    est = paired_speedup(paired_throughput_of(minutes, at, until).get(bucket, {}).get(n, []))
    if est is not None:
        return Realised(est.ratio, "paired", est.low, est.high, est.minutes)
    if not ended and now - at < patience:
        return None  # paired minutes may yet come
    span = throughput_of(minutes, at, until).get(bucket, {})
    ratio = measured_speedups({bucket: {n: span[n]}} if n in span else {}, plain).get(bucket, {}).get(n)
    return None if ratio is None else Realised(ratio, "unpaired")


def latency(arms: dict[bool, ArmLatency], bucket: int, n: int) -> dict[str, Any] | None:
    """A closed decision's ``realised_latency``: its setting's requests (speculating at ``bucket``
    over its span) and the plain ones beside them, each with TTFT and TPOT p50 / p95, and setting /
    plain per percentile where both sides have it.  None where no request ran at the setting."""
    setting, plain = arms.get(True), arms.get(False)
    if setting is None:
        return None
    ratios: dict[str, float] = {}
    if plain is not None:
        for metric in ("ttft_s", "tpot_s"):
            for q, value in getattr(setting, metric).items():
                base = getattr(plain, metric).get(q)
                if value is not None and base:
                    ratios[f"{metric.removesuffix('_s')}_{q}"] = value / base
    return {"bucket": bucket, "n": n, "setting": asdict(setting), "plain": None if plain is None else asdict(plain),
            "vs_plain": ratios}  # fmt: skip
