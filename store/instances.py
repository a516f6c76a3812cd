"""Engine instances: who is serving what, and when each was last seen."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Engine, select

from .db import conflict_insert
from .models import EngineInstance


def heartbeat(
    db: Engine,
    instance_id: str,
    model: str,
    method: str,
    capacity: int,
    started_at: datetime,
    degraded_reason: str | None,
    settings_version: int | None = None,
    draft_model: str | None = None,
) -> None:
    """Insert or refresh the instance row (idempotent upsert on both stores)."""
    values = dict(
        instance_id=instance_id,
        model=model,
        method=method,
        capacity=capacity,
        started_at=started_at,
        last_seen_at=datetime.now(UTC),
        degraded_reason=degraded_reason,
        settings_version=settings_version,
        draft_model=draft_model,
    )
    stmt = conflict_insert(db, EngineInstance).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[EngineInstance.instance_id],
        set_={k: stmt.excluded[k] for k in values if k != "instance_id"},
    )
    with db.begin() as conn:
        conn.execute(stmt)


LIVE_S = 60.0  # an instance not seen for longer is stale (heartbeats come every 15 s)


def fleet(db: Engine, policy_version: int | None, policy_at: datetime | None, grace_s: float = 30.0) -> list[dict]:
    """Every instance with what it holds; ``behind``: live, and still on an older settings version
    than the policy ``grace_s`` after the policy changed (propagation takes a poll interval)."""
    now = datetime.now(UTC)
    with db.connect() as conn:
        rows = conn.execute(select(EngineInstance.__table__).order_by(EngineInstance.instance_id)).all()
    settled = policy_version is not None and policy_at is not None and (now - policy_at).total_seconds() > grace_s
    out = []
    for r in rows:
        seen_ago = (now - r.last_seen_at).total_seconds()
        live = seen_ago <= LIVE_S
        behind = live and settled and (r.settings_version is None or r.settings_version < policy_version)
        out.append({**r._asdict(), "seen_s_ago": round(seen_ago, 1), "live": live, "behind": behind})
    return out
