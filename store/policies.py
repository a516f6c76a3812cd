"""Versioned policy storage with optimistic concurrency and an audit trail.

One policy document (scope ``default``) is current at a time.  A write names
the version it read; ``UPDATE ... WHERE version = :read`` makes the database
decide races, so of two writers with the same version exactly one wins and
the other gets ``StaleVersionError`` -- never a lost update.  Every version is
kept, and every change leaves an audit entry (who, when, why, what changed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, update

from .models import AuditEntry, Policy, PolicyVersion

SCOPE = "default"


class StaleVersionError(Exception):
    def __init__(self, current: int) -> None:
        super().__init__(f"policy changed meanwhile: current version is {current}")
        self.current = current


@dataclass(frozen=True)
class Versioned:
    version: int
    body: dict[str, Any]
    at: datetime
    by: str


def json_diff(before: Any, after: Any, path: str = "") -> list[dict[str, Any]]:
    """Changed leaves as [{path, before, after}] (dicts recurse, a missing dict
    counts as empty; lists compare whole)."""
    if isinstance(before, dict) or isinstance(after, dict):
        if before is None:
            before = {}
        if after is None:
            after = {}
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after)):
            out += json_diff(before.get(key), after.get(key), f"{path}/{key}")
        return out
    return [] if before == after else [{"path": path or "/", "before": before, "after": after}]


def _utc_now() -> datetime:
    return datetime.now(UTC)


class PolicyRepository:
    def __init__(self, db: Engine, clock: Callable[[], datetime] = _utc_now) -> None:
        self.db, self.clock = db, clock

    def current(self) -> Versioned | None:
        with self.db.connect() as conn:
            row = conn.execute(select(Policy.__table__).where(Policy.scope == SCOPE)).first()
        return None if row is None else Versioned(row.version, row.body, row.updated_at, row.updated_by)

    def ensure(self, body: dict[str, Any], actor: str) -> Versioned:
        """Create version 1 from ``body`` if there is no policy yet."""
        existing = self.current()
        if existing is not None:
            return existing
        now = self.clock()
        with self.db.begin() as conn:
            conn.execute(insert(Policy).values(scope=SCOPE, version=1, body=body, updated_at=now, updated_by=actor))
            conn.execute(
                insert(PolicyVersion).values(scope=SCOPE, version=1, body=body, created_at=now, created_by=actor)
            )
            conn.execute(
                insert(AuditEntry).values(
                    at=now,
                    actor=actor,
                    action="create",
                    scope=SCOPE,
                    reason="initial policy",
                    diff={"changes": json_diff({}, body)},
                )
            )
        return Versioned(1, body, now, actor)

    def write(
        self,
        body: dict[str, Any],
        expected: int,
        actor: str,
        reason: str | None,
        action: str,
        conn: Connection | None = None,
    ) -> Versioned:
        """A new version after ``expected``; in ``conn``'s transaction where given (with other writes)."""
        if conn is None:
            with self.db.begin() as own:
                return self.write(body, expected, actor, reason, action, own)
        now = self.clock()
        old = conn.execute(select(Policy.__table__).where(Policy.scope == SCOPE)).one()
        result = conn.execute(
            update(Policy)
            .where(Policy.scope == SCOPE, Policy.version == expected)
            .values(version=expected + 1, body=body, updated_at=now, updated_by=actor)
        )
        if result.rowcount != 1:
            raise StaleVersionError(old.version)
        conn.execute(
            insert(PolicyVersion).values(scope=SCOPE, version=expected + 1, body=body, created_at=now, created_by=actor)
        )
        conn.execute(
            insert(AuditEntry).values(
                at=now,
                actor=actor,
                action=action,
                scope=SCOPE,
                reason=reason,
                diff={"from_version": expected, "to_version": expected + 1, "changes": json_diff(old.body, body)},
            )
        )
        return Versioned(expected + 1, body, now, actor)

    def versions(self, limit: int, offset: int) -> list[Versioned]:
        with self.db.connect() as conn:
            rows = conn.execute(
                select(PolicyVersion.__table__)
                .where(PolicyVersion.scope == SCOPE)
                .order_by(PolicyVersion.version.desc())
                .limit(limit)
                .offset(offset)
            ).all()
        return [Versioned(r.version, r.body, r.created_at, r.created_by) for r in rows]

    def version(self, number: int) -> Versioned | None:
        with self.db.connect() as conn:
            r = conn.execute(
                select(PolicyVersion.__table__).where(PolicyVersion.scope == SCOPE, PolicyVersion.version == number)
            ).first()
        return None if r is None else Versioned(r.version, r.body, r.created_at, r.created_by)

    def audit(self, limit: int, offset: int) -> list[Any]:
        with self.db.connect() as conn:
            return list(
                conn.execute(
                    select(AuditEntry.__table__).order_by(AuditEntry.id.desc()).limit(limit).offset(offset)
                ).all()
            )
