"""The tuner's leader lease: exactly one tuner decides at a time, and a stale one cannot write.

On PostgreSQL the lease is a session advisory lock held on a connection of its
own.  Holding it once proves nothing later: the session can be terminated
(a failover, an idle-session killer, ``pg_terminate_backend``) and another
replica can take the lock while this process still believes it leads.  So

* every ``acquire`` re-checks that this session still holds the lock
  (``pg_locks``), and reconnects and competes again when it does not;
* each acquisition bumps the lease's *epoch* in ``tuner_leases``;
* every write a tuner makes runs ``fence`` first, in the same transaction: it
  locks the lease row and refuses (``StaleLeaderError``) when the epoch is no
  longer this holder's.  A leader that lost its lock between its check and its
  write is refused by the database, not by its own belief.

SQLite is one process: the lease is held from the first run, with an epoch all
the same (so decision rows read alike on both stores).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine, insert, select, text, update

from .models import TunerLease

log = logging.getLogger(__name__)

LOCK_KEY = 0x5BEC7E  # pg advisory lock id for the tuner leader
LEASE = "tuner"

_HOLDS_LOCK = text(
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND pid = pg_backend_pid() AND classid = 0 AND objid = :k AND objsubid = 1)"
)


class StaleLeaderError(Exception):
    """A write by a tuner whose lease epoch is no longer the current one."""


class LeaderLease:
    def __init__(self, db: Engine, holder: str) -> None:
        self.db, self.holder = db, holder
        self.epoch: int | None = None
        self._conn: Connection | None = None

    def acquire(self) -> int | None:
        """This holder's epoch while it leads, else None (it decides nothing this run)."""
        if self.db.dialect.name == "sqlite":
            if self.epoch is None:
                self.epoch = self._next_epoch()
            return self.epoch
        try:
            if self._conn is not None and self.epoch is not None:
                if self._conn.execute(_HOLDS_LOCK, {"k": LOCK_KEY}).scalar():
                    self._conn.commit()
                    return self.epoch
                log.warning("tuner leader lock lost (epoch %s)", self.epoch)
                self._drop()
            self._conn = self._conn or self.db.connect()
            got = bool(self._conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar())
            self._conn.commit()
            if got:
                self.epoch = self._next_epoch()
                log.info("tuner leader: %s, epoch %s", self.holder, self.epoch)
                return self.epoch
        except Exception:  # the session died or the server is away: no leader this round
            log.exception("tuner leader lock unavailable")
            self._drop()
        self.epoch = None
        return None

    def _drop(self) -> None:
        conn, self._conn, self.epoch = self._conn, None, None
        if conn is not None:
            try:
                conn.invalidate()  # a dead session must not go back to the pool
                conn.close()
            except Exception:
                log.debug("closing the lost leader connection failed", exc_info=True)

    def _next_epoch(self) -> int:
        now = datetime.now(UTC)
        with self.db.begin() as conn:
            current = conn.execute(select(TunerLease.epoch).where(TunerLease.name == LEASE).with_for_update()).scalar()
            if current is None:
                conn.execute(insert(TunerLease).values(name=LEASE, epoch=1, holder=self.holder, acquired_at=now))
                return 1
            # the row is locked (FOR UPDATE) until commit: the next epoch is the one read plus one
            conn.execute(
                update(TunerLease)
                .where(TunerLease.name == LEASE)
                .values(epoch=current + 1, holder=self.holder, acquired_at=now)
            )
            return current + 1

    def fence(self, conn: Connection) -> None:
        """Inside a write's transaction: lock the lease row; refuse unless it is still this epoch."""
        current = conn.execute(select(TunerLease.epoch).where(TunerLease.name == LEASE).with_for_update()).scalar()
        if self.epoch is None or current != self.epoch:
            raise StaleLeaderError(f"lease epoch is {current}, this tuner holds {self.epoch}: its writes are refused")
