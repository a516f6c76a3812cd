"""What the tuner reads from the store: acceptance counts per class and step
times per N over a window, and when each class was last changed."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, func, select

from .models import RequestRecordRow, StepStat, TunerDecision
from .steps import add_positions


def acceptance_counts(db: Engine, window: timedelta) -> dict[str, tuple[list[int], list[int]]]:
    """class -> (drafted per position, accepted per position) over the window."""
    since = datetime.now(UTC) - window
    out: dict[str, tuple[list[int], list[int]]] = {}
    query = select(
        RequestRecordRow.prompt_class, RequestRecordRow.drafted_per_position, RequestRecordRow.accepted_per_position
    ).where(RequestRecordRow.finish_time >= since, RequestRecordRow.num_draft_tokens > 0)
    with db.connect() as conn:
        for cls, drafted, accepted in conn.execute(query):
            d, a = out.setdefault(cls, ([], []))
            add_positions(d, drafted)
            add_positions(a, accepted)
    return out


def step_times(db: Engine, window: timedelta) -> tuple[int | None, dict[int, float]]:
    """Mean step time per N in the busiest batch bucket of the window: (bucket, {N: seconds})."""
    since = (datetime.now(UTC) - window).replace(second=0, microsecond=0)
    S = StepStat
    with db.connect() as conn:
        rows = conn.execute(
            select(S.batch_bucket, S.num_speculative_tokens, func.sum(S.steps), func.sum(S.step_time_sum_s))
            .where(S.minute >= since)
            .group_by(S.batch_bucket, S.num_speculative_tokens)
        ).all()
    steps_per_bucket: dict[int, int] = defaultdict(int)
    for bucket, _n, steps, _t in rows:
        steps_per_bucket[bucket] += steps
    if not steps_per_bucket:
        return None, {}
    busiest = max(steps_per_bucket, key=steps_per_bucket.get)
    return busiest, {n: t / steps for bucket, n, steps, t in rows if bucket == busiest and steps}


def last_applied(db: Engine) -> dict[str, datetime]:
    """class -> time of the tuner's last applied change."""
    with db.connect() as conn:
        rows = conn.execute(
            select(TunerDecision.prompt_class, func.max(TunerDecision.at))
            .where(TunerDecision.applied.is_(True))
            .group_by(TunerDecision.prompt_class)
        ).all()
    return {cls: at for cls, at in rows}
