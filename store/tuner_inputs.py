"""What the tuner reads from the store: acceptance counts per class, step
times per batch bucket and N, when each class was last changed, and what
happened after a decision (when its setting was replaced; its realised speedup).  Every read takes explicit
times so the tuner (and the replay benchmark) own the clock."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import aliased

from .aggregates import ArmLatency, acceptance_by_class, latency_by_arm
from .models import StepStat, TunerDecision


def acceptance_counts(
    db: Engine, since: datetime, until: datetime | None = None
) -> dict[str, tuple[list[int], list[int]]]:
    """class -> (drafted per position, accepted per position) of requests finished in [since, until)."""
    return {
        cls: (g.drafted_per_position, g.accepted_per_position)
        for cls, g in acceptance_by_class(db, since, until, drafted_only=True).items()
    }


@dataclass(frozen=True)
class StepMinute:
    """One writer-summed row of ``step_stats``: a minute, an instance, a batch bucket, an N."""

    minute: datetime
    instance: str
    bucket: int
    n: int
    steps: int
    time_s: float
    batch_sum: int
    drafted: int
    accepted: int
    prefill_steps: int
    prefill_time_s: float
    prefill_generated: int

    def delivered(self) -> tuple[int, float, int]:
        """(steps, seconds, tokens generated) of every step in the row, prompts' steps included:
        what serving at this key delivered."""
        return (self.steps + self.prefill_steps, self.time_s + self.prefill_time_s,
                self.batch_sum + self.accepted + self.prefill_generated)  # fmt: skip


def step_minutes(db: Engine, since: datetime, until: datetime | None = None) -> list[StepMinute]:
    """Step statistics per minute, bucket and N over the minutes in [since, until), in one read:
    a tuner run (and its closing of decisions) derives every range it needs from them."""
    S = StepStat
    query = select(
        S.minute,
        S.instance_id,
        S.batch_bucket,
        S.num_speculative_tokens,
        func.sum(S.steps),
        func.sum(S.step_time_sum_s),
        func.sum(S.batch_size_sum),
        func.sum(S.num_draft_tokens),
        func.sum(S.num_accepted_tokens),
        func.sum(S.prefill_steps),
        func.sum(S.prefill_time_sum_s),
        func.sum(S.prefill_generated_tokens),
    ).where(S.minute >= _minute(since))
    if until is not None:
        query = query.where(S.minute < until)
    with db.connect() as conn:
        rows = conn.execute(query.group_by(S.minute, S.instance_id, S.batch_bucket, S.num_speculative_tokens)).all()
    return [StepMinute(r[0], r[1], *(int(x) for x in r[2:5]), float(r[5]), *(int(x) for x in r[6:10]),
                       float(r[10]), int(r[11])) for r in rows]  # fmt: skip


def _minute(t: datetime) -> datetime:
    return t.replace(second=0, microsecond=0)


def _within(rows: list[StepMinute], since: datetime, until: datetime | None) -> list[StepMinute]:
    lo = _minute(since)
    return [r for r in rows if r.minute >= lo and (until is None or r.minute < until)]


def times_of(
    rows: list[StepMinute], since: datetime, until: datetime | None = None
) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, int]]]:
    """({bucket: {N: mean step time}}, {bucket: {N: steps}}) over the minutes in [since, until)."""
    sums: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0])
    for r in _within(rows, since, until):
        sums[(r.bucket, r.n)][0] += r.steps
        sums[(r.bucket, r.n)][1] += r.time_s
    times: dict[int, dict[int, float]] = defaultdict(dict)
    counts: dict[int, dict[int, int]] = defaultdict(dict)
    for (bucket, n), (steps, total) in sums.items():
        if steps:
            times[bucket][n] = total / steps
            counts[bucket][n] = int(steps)
    return dict(times), dict(counts)


def throughput_of(
    rows: list[StepMinute], since: datetime, until: datetime | None = None
) -> dict[int, dict[int, tuple]]:
    """{bucket: {N: (tokens generated, seconds, steps)}} over the minutes in [since, until): every step
    at that key, prompts' steps included -- what serving there delivered, measured."""
    out: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0]))
    for r in _within(rows, since, until):
        entry = out[r.bucket][r.n]
        steps, seconds, tokens = r.delivered()
        entry[0] += tokens
        entry[1] += seconds
        entry[2] += steps
    return {b: {n: tuple(v) for n, v in per.items()} for b, per in out.items()}


def paired_of(
    rows: list[StepMinute], since: datetime, until: datetime | None = None
) -> dict[int, dict[int, list[tuple[int, float, int, float]]]]:
    """{bucket: {N: [(plain steps, their seconds, steps at N, their seconds) per minute]}}: the decode
    steps of ``paired_minutes`` -- what a noise-proof cost ratio is taken from (``tuner/paired_cost.py``)."""
    return _per_bucket_n(
        (b, n, (p.steps, p.time_s, r.steps, r.time_s)) for b, n, p, r in paired_minutes(rows, since, until)
    )


def paired_throughput_of(
    rows: list[StepMinute], since: datetime, until: datetime | None = None
) -> dict[int, dict[int, list[tuple[int, float, int, float, int, int]]]]:
    """{bucket: {N: [(plain steps, seconds, steps at N, seconds, plain tokens, tokens at N) per minute]}}:
    every step of ``paired_minutes``, prompts' steps included (``StepMinute.delivered``) -- what the
    measured speedup over plain is taken from."""
    out = []
    for b, n, p, r in paired_minutes(rows, since, until):
        (s0, t0, g0), (sn, tn, gn) = p.delivered(), r.delivered()
        out.append((b, n, (s0, t0, sn, tn, g0, gn)))
    return _per_bucket_n(out)


def paired_minutes(
    rows: list[StepMinute], since: datetime, until: datetime | None = None
) -> list[tuple[int, int, StepMinute, StepMinute]]:
    """(bucket, N, plain row, row at N) for every minute in [since, until) in which one instance ran
    both plain decode steps and steps at N at that bucket.  Pairs never span instances: a machine's
    drift is its own."""
    sides: dict[tuple, dict[int, StepMinute]] = defaultdict(dict)
    for r in _within(rows, since, until):  # one row per minute, instance, bucket and N (step_minutes)
        sides[(r.minute, r.instance, r.bucket)][r.n] = r
    out = []
    for (_, _, bucket), per_n in sorted(sides.items()):
        plain = per_n.get(0)
        if plain is None or not plain.steps:
            continue
        out.extend((bucket, n, plain, r) for n, r in per_n.items() if n > 0 and r.steps)
    return out


def _per_bucket_n(items: Iterable[tuple[int, int, tuple]]) -> dict[int, dict[int, list[tuple]]]:
    out: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for bucket, n, value in items:
        out[bucket][n].append(value)
    return {b: dict(per) for b, per in out.items()}


def drafting_share_of(rows: list[StepMinute], since: datetime, until: datetime | None = None) -> dict[int, dict]:
    """{bucket: {N: share of the requests in decode steps at N that drafted}} over [since, until): draft
    tokens over N per request of the batch (a demoted request runs in the step, drafts nothing)."""
    sums: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for r in _within(rows, since, until):
        if r.n > 0 and r.batch_sum:
            sums[(r.bucket, r.n)][0] += r.drafted
            sums[(r.bucket, r.n)][1] += r.n * r.batch_sum
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for (bucket, n), (drafted, possible) in sums.items():
        out[bucket][n] = min(1.0, drafted / possible)
    return dict(out)


MIN_PREFILL_STEPS = 3  # steps that also prefilled, per bucket and side, for their cost to count as measured


def prefill_of(
    rows: list[StepMinute], since: datetime, until: datetime | None = None
) -> dict[int, dict[str, float | None]]:
    """{bucket: {"batch": mean batch size, "off": u, "on": u}} over the minutes in [since, until).

    u is what steps that also prefilled cost beyond a decode step at the same key (N = 0 for
    "off", N > 0 for "on"), per token generated at that side of the bucket; None where fewer
    than ``MIN_PREFILL_STEPS`` such steps ran.  Noise can make the excess negative: it counts as 0.
    """
    keys: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0] * 7)
    for r in _within(rows, since, until):
        k = keys[(r.bucket, r.n)]
        for i, v in enumerate((r.steps, r.time_s, r.batch_sum, r.accepted, r.prefill_steps, r.prefill_time_s,
                               r.prefill_generated)):  # fmt: skip
            k[i] += v
    sides: dict[int, dict[str, list[float]]] = defaultdict(lambda: {"off": [0, 0, 0], "on": [0, 0, 0]})
    batch: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for (bucket, n), (steps, time_s, batch_sum, accepted, p_steps, p_time, p_generated) in keys.items():
        batch[bucket][0] += batch_sum
        batch[bucket][1] += steps
        side = sides[bucket]["on" if n > 0 else "off"]
        side[1] += batch_sum + accepted + p_generated  # every token of the side shares its prompts' cost
        if steps and p_steps:
            side[0] += p_time - p_steps * time_s / steps  # beyond the decode step it also was
            side[2] += p_steps
    out: dict[int, dict[str, float | None]] = {}
    for bucket, (batch_sum, steps) in batch.items():
        if not steps:
            continue
        entry: dict[str, float | None] = {"batch": batch_sum / steps}
        for name, (excess, generated, p_steps) in sides[bucket].items():
            entry[name] = max(0.0, excess) / generated if p_steps >= MIN_PREFILL_STEPS and generated else None
        out[bucket] = entry
    return out


def prefill_costs(db: Engine, since: datetime, until: datetime | None = None) -> dict[int, dict[str, float | None]]:
    """``prefill_of`` read from the store."""
    return prefill_of(step_minutes(db, since, until), since, until)


MEASUREMENT_ACTIONS = ("explore", "cost_probe", "reprobe")  # measurements: no cooldown after them


@dataclass(frozen=True)
class Applied:
    """One applied tuner decision: what it did, when, the N it found and left at its batch bucket, and
    when the class's next applied decision replaced it (None: still in force)."""

    action: str
    at: datetime
    n_before: int
    n_after: int
    until: datetime | None = None

    @property
    def in_force(self) -> bool:
        """Whether its setting still runs: no applied decision of the class came after it."""
        return self.until is None

    def in_force_for(self, now: datetime) -> timedelta:
        """How long its setting ran: until the next applied decision, or until ``now``."""
        return (self.until or now) - self.at


@dataclass(frozen=True)
class LastApplied:
    """Per class, the tuner's last applied decision of each action (one read)."""

    by_class: dict[str, dict[str, Applied]]

    def age(self, prompt_class: str, now: datetime, action: str | None = None) -> timedelta:
        """How long ago ``action`` was last applied to the class, or (None) its last change, measurements
        excluded; ``timedelta.max`` if never."""
        done = self.by_class.get(prompt_class, {})
        if action is not None:
            at = done[action].at if action in done else None
        else:
            at = max((a.at for a in done.values() if a.action not in MEASUREMENT_ACTIONS), default=None)
        return timedelta.max if at is None else now - at

    def last(self, prompt_class: str, action: str) -> Applied | None:
        """The class's last applied ``action``, if any."""
        return self.by_class.get(prompt_class, {}).get(action)

    def exploration(self, prompt_class: str) -> Applied | None:
        """The exploration in force: the class's last applied ``explore``, where nothing replaced it."""
        explored = self.last(prompt_class, "explore")
        return explored if explored is not None and explored.in_force else None


def last_applied(db: Engine) -> LastApplied:
    """``LastApplied`` read from the store."""
    D = TunerDecision
    last = (
        select(D.prompt_class, D.action, func.max(D.at).label("at"))
        .where(D.applied.is_(True))
        .group_by(D.prompt_class, D.action)
        .subquery()
    )
    later = aliased(D)
    until = (
        select(func.min(later.at))
        .where(later.prompt_class == D.prompt_class, later.applied.is_(True), later.at > D.at)
        .scalar_subquery()
    )
    with db.connect() as conn:
        rows = conn.execute(
            select(D.prompt_class, D.action, D.at, D.n_before, D.n_after, until)
            .join(last, (D.prompt_class == last.c.prompt_class) & (D.action == last.c.action) & (D.at == last.c.at))
            .where(D.applied.is_(True))
        ).all()
    by_class: dict[str, dict[str, Applied]] = defaultdict(dict)
    for cls, action, at, n_before, n_after, replaced in rows:
        by_class[cls][action] = Applied(action, at, n_before, n_after, replaced)
    return LastApplied(dict(by_class))


def decisions_awaiting_outcome(db: Engine, before: datetime, max_age: timedelta) -> list[dict]:
    """Decisions that left speculation on, have no realised speedup yet, and are older than ``before``."""
    D = TunerDecision
    with db.connect() as conn:
        rows = conn.execute(
            select(D.id, D.at, D.prompt_class, D.batch_bucket, D.n_after)
            .where(
                D.realised_speedup.is_(None),
                D.n_after > 0,
                D.at < before,
                D.at >= before - max_age,
                (D.applied.is_(True)) | (D.action == "keep"),
            )
            .order_by(D.at)
        ).all()
    return [r._asdict() for r in rows]


class ChangeTimes:
    """When each class's setting was changed by the tuner from ``since`` on (its applied decisions, one
    read): a decision's setting stays in force until the next of them."""

    def __init__(self, db: Engine, since: datetime) -> None:
        D = TunerDecision
        with db.connect() as conn:
            rows = conn.execute(
                select(D.prompt_class, D.at).where(D.at >= since, D.applied.is_(True)).order_by(D.at)
            ).all()
        self._times: dict[str, list[datetime]] = defaultdict(list)
        for cls, at in rows:
            self._times[cls].append(at)

    def next_after(self, prompt_class: str, after: datetime) -> datetime | None:
        times = self._times.get(prompt_class, [])
        i = bisect_right(times, after)
        return times[i] if i < len(times) else None


def span_latency(
    db: Engine, prompt_class: str, bucket: int, since: datetime, until: datetime
) -> dict[bool, ArmLatency]:
    """{speculating: latency} of a class's requests finished in [since, until) whose mean batch size
    falls in ``bucket`` (the steps' power-of-two buckets: 8 holds 5-8, as (4, 8])."""
    return latency_by_arm(db, since, until, prompt_class, batch=(bucket // 2, bucket)).get(prompt_class, {})


@dataclass(frozen=True)
class Realised:
    """What a decision's setting delivered against plain, and how it was measured."""

    speedup: float
    estimator: str  # "paired" | "unpaired" (``tuner/outcomes.py``)
    low: float | None = None  # the 90 % interval, paired only
    high: float | None = None
    minutes: int | None = None  # paired minutes it came from
    latency: dict | None = None  # TTFT and TPOT of its setting against plain (``outcomes.latency``)


def set_realised(db: Engine, outcomes: dict[int, Realised]) -> None:
    """Close decisions (id -> what they realised), in one transaction."""
    if not outcomes:
        return
    D = TunerDecision
    with db.begin() as conn:
        for decision_id, r in outcomes.items():
            columns = {f"realised_{k}": v for k, v in asdict(r).items()}  # realised_speedup, realised_low, ...
            conn.execute(update(D).where(D.id == decision_id).values(**columns))
