"""Engine instances: who is serving what, and when each was last seen."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Engine
from sqlalchemy.dialects import postgresql, sqlite

from .models import EngineInstance


def heartbeat(
    db: Engine,
    instance_id: str,
    model: str,
    method: str,
    capacity: int,
    started_at: datetime,
    degraded_reason: str | None,
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
    )
    dialect = postgresql if db.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(EngineInstance).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[EngineInstance.instance_id],
        set_={
            k: stmt.excluded[k]
            for k in ("model", "method", "capacity", "started_at", "last_seen_at", "degraded_reason")
        },
    )
    with db.begin() as conn:
        conn.execute(stmt)
