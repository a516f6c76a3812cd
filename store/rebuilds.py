"""Rolling changes across a fleet: one rebuild slot, so at most one engine is paused at a time.

A method or drafter change needs a managed rebuild of each engine (vLLM fixes
the drafter at start-up).  An engine that needs one asks the control plane for
the slot, rebuilds (its requests wait, none fail), and gives the slot back once
it serves again; the next engine gets it then.  The slot expires after ``ttl``,
so an engine that dies mid-rebuild does not block the fleet for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from .models import RebuildSlot

SLOT = "default"


@dataclass(frozen=True)
class Slot:
    holder: str | None  # None: free
    expires_at: datetime | None


def acquire(db: Engine, holder: str, ttl: timedelta = timedelta(minutes=10)) -> tuple[bool, Slot]:
    """Take (or renew) the slot for ``holder`` unless another live holder has it: (granted, slot now)."""
    now = datetime.now(UTC)
    values = dict(holder=holder, acquired_at=now, expires_at=now + ttl)
    try:
        with db.begin() as conn:
            row = conn.execute(select(RebuildSlot.__table__).where(RebuildSlot.name == SLOT).with_for_update()).first()
            if row is None:
                conn.execute(insert(RebuildSlot).values(name=SLOT, **values))
            elif row.holder == holder or row.expires_at <= now:
                conn.execute(update(RebuildSlot).where(RebuildSlot.name == SLOT).values(**values))
            else:
                return False, Slot(row.holder, row.expires_at)
    except IntegrityError:  # another engine inserted the slot first
        return False, current(db)
    return True, Slot(holder, now + ttl)


def release(db: Engine, holder: str) -> bool:
    """Give the slot back (only its holder can); False when ``holder`` did not hold it."""
    query = delete(RebuildSlot).where(RebuildSlot.name == SLOT, RebuildSlot.holder == holder)
    with db.begin() as conn:
        return conn.execute(query).rowcount == 1


def current(db: Engine) -> Slot:
    with db.connect() as conn:
        row = conn.execute(select(RebuildSlot.__table__).where(RebuildSlot.name == SLOT)).first()
    if row is None or row.expires_at <= datetime.now(UTC):
        return Slot(None, None)
    return Slot(row.holder, row.expires_at)
