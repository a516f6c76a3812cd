"""What the tuner reads from the store: acceptance counts per class, step
times per batch bucket and N, when each class was last changed, and what
happened after a decision (its realised speedup).  Every read takes explicit
times so the tuner (and the replay benchmark) own the clock."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from sqlalchemy import Engine, func, select, update

from .models import RequestRecordRow, StepStat, TunerDecision
from .steps import add_positions


def acceptance_counts(
    db: Engine, since: datetime, until: datetime | None = None
) -> dict[str, tuple[list[int], list[int]]]:
    """class -> (drafted per position, accepted per position) of requests finished in [since, until)."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    R = RequestRecordRow
    query = select(R.prompt_class, R.drafted_per_position, R.accepted_per_position).where(
        R.finish_time >= since, R.num_draft_tokens > 0
    )
    if until is not None:
        query = query.where(R.finish_time < until)
    with db.connect() as conn:
        for cls, drafted, accepted in conn.execute(query):
            d, a = out.setdefault(cls, ([], []))
            add_positions(d, drafted)
            add_positions(a, accepted)
    return out


def tokens_per_step(db: Engine, prompt_class: str, since: datetime, until: datetime) -> tuple[float, int] | None:
    """(1 + accepted per verify step, verify steps) of one class's requests finished in [since, until)."""
    R = RequestRecordRow
    with db.connect() as conn:
        steps, accepted = conn.execute(
            select(func.sum(R.num_spec_steps), func.sum(R.num_accepted_tokens)).where(
                R.prompt_class == prompt_class, R.finish_time >= since, R.finish_time < until, R.num_spec_steps > 0
            )
        ).one()
    if not steps:
        return None
    return 1 + accepted / steps, int(steps)


def step_times(
    db: Engine, since: datetime, until: datetime | None = None
) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, int]]]:
    """({bucket: {N: mean step time}}, {bucket: {N: steps}}) over the minutes in [since, until)."""
    S = StepStat
    query = select(S.batch_bucket, S.num_speculative_tokens, func.sum(S.steps), func.sum(S.step_time_sum_s)).where(
        S.minute >= since.replace(second=0, microsecond=0)
    )
    if until is not None:
        query = query.where(S.minute < until)
    with db.connect() as conn:
        rows = conn.execute(query.group_by(S.batch_bucket, S.num_speculative_tokens)).all()
    times: dict[int, dict[int, float]] = defaultdict(dict)
    counts: dict[int, dict[int, int]] = defaultdict(dict)
    for bucket, n, steps, total in rows:
        if steps:
            times[bucket][n] = total / steps
            counts[bucket][n] = int(steps)
    return dict(times), dict(counts)


MEASUREMENT_ACTIONS = ("explore", "cost_probe")  # one-interval measurements: no cooldown after them


def last_applied(db: Engine, action: str | None = None) -> dict[str, datetime]:
    """class -> time of the tuner's last applied decision with ``action``, or (None) its last change,
    measurements excluded."""
    D = TunerDecision
    only = D.action == action if action is not None else D.action.not_in(MEASUREMENT_ACTIONS)
    with db.connect() as conn:
        rows = conn.execute(
            select(D.prompt_class, func.max(D.at)).where(D.applied.is_(True), only).group_by(D.prompt_class)
        ).all()
    return {cls: at for cls, at in rows}


def decisions_awaiting_outcome(db: Engine, before: datetime, max_age: timedelta) -> list[dict]:
    """Decisions that left speculation on, have no realised speedup yet, and are older than ``before``."""
    D = TunerDecision
    with db.connect() as conn:
        rows = conn.execute(
            select(D.id, D.at, D.prompt_class, D.batch_bucket, D.n_after, D.inputs)
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


def next_decision_time(db: Engine, prompt_class: str, after: datetime) -> datetime | None:
    with db.connect() as conn:
        return conn.execute(
            select(func.min(TunerDecision.at)).where(
                TunerDecision.prompt_class == prompt_class, TunerDecision.at > after
            )
        ).scalar()


def set_realised(db: Engine, decision_id: int, realised: float) -> None:
    with db.begin() as conn:
        conn.execute(update(TunerDecision).where(TunerDecision.id == decision_id).values(realised_speedup=realised))
