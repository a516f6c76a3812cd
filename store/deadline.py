"""A client-side deadline for every database statement.

A PostgreSQL server that hangs (stopped, or a network partition) keeps its TCP
connections open: the kernel still acknowledges, so neither ``statement_timeout``
(server side) nor TCP keepalives end a blocked read, and the caller waits forever.
``StatementDeadline`` arms a deadline before each statement and, when it passes,
shuts the connection's socket down: the blocked driver call fails at once with an
``OperationalError``, SQLAlchemy discards the connection, and the caller sees an
ordinary "database unavailable" error.  One watcher thread serves every connection.

After a deadline has passed (or a connect ran into its timeout) the server is known not to
answer, and waiting again costs every caller the full deadline -- a policy write waits for the
pool's pre-ping and then for a new connect, twice.  So from then on new connections (and the
pool's pre-pings) are refused at once with ``DatabaseNotAnswering``, until a background probe,
one connect per deadline, gets through; statements on open connections keep their own deadline.
No caller waits on a server known not to answer, however slowly the callers come.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import psycopg
from sqlalchemy import Engine, event
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)
_deadlines: weakref.WeakKeyDictionary[Engine, StatementDeadline] = weakref.WeakKeyDictionary()


def deadline_of(engine: Engine) -> StatementDeadline | None:
    """The deadline ``make_engine`` put on ``engine`` (None: SQLite, or no timeout)."""
    return _deadlines.get(engine)


class DatabaseNotAnswering(psycopg.OperationalError):
    """Refused without a round trip: the server is known not to answer."""


def _dbapi(conn: Any) -> Any:
    """The driver connection under a SQLAlchemy one; None once it was invalidated (nothing to watch)."""
    try:
        return None if conn is None else conn.connection.dbapi_connection
    except SQLAlchemyError:
        return None


def _waiting_on_server(dbapi: Any) -> bool:
    """A round trip is in flight (libpq: a command sent, its result not yet in).  A ``commit`` arms
    the deadline and no event follows it, so a connection kept open after one -- the tuner leader's,
    which holds its lock between runs -- is idle, not hung, when the deadline passes."""
    from psycopg.pq import TransactionStatus

    return dbapi.info.transaction_status == TransactionStatus.ACTIVE


class StatementDeadline:
    """Armed for every round trip a connection makes -- statements, commits, rollbacks (also the
    pool's reset on return) and the pool's pre-ping -- and disarmed when it returns."""

    def __init__(self, engine: Engine, seconds: float) -> None:
        self.seconds = seconds
        self.severed = 0
        # id(dbapi connection) -> (deadline, weak reference): a closed connection's descriptor may
        # already belong to another socket, so the connection is looked at again before severing.
        self._armed: dict[int, tuple[float, weakref.ref]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.refused = 0  # connects and pre-pings refused while the server was known not to answer
        self.expired = 0  # passed deadlines the watcher has dealt with (severed or, after a commit, idle)
        self._down_since: float | None = None  # monotonic; set while the server is known not to answer
        self._probe: threading.Thread | None = None
        self.failed_probes = 0
        self._last_connect: tuple[tuple, dict] | None = None  # what the probe connects with
        _deadlines[engine] = self
        event.listen(engine, "before_cursor_execute", lambda conn, *_: self.arm(_dbapi(conn)))
        event.listen(engine, "after_cursor_execute", lambda conn, *_: self.disarm(_dbapi(conn)))
        event.listen(engine, "commit", lambda conn: self.arm(_dbapi(conn)))
        event.listen(engine, "rollback", lambda conn: self.arm(_dbapi(conn)))
        event.listen(engine, "handle_error", lambda context: self.disarm(_dbapi(context.connection)))
        event.listen(engine.pool, "reset", lambda dbapi, *_: self.arm(dbapi))
        event.listen(engine.pool, "checkin", lambda dbapi, *_: self.disarm(dbapi))
        ping = engine.dialect.do_ping

        def do_ping(dbapi: Any) -> bool:  # the pool's pre-ping bypasses statement events
            if self._down_since is not None:
                self.refused += 1
                return False  # the pool discards the connection and connects anew: refused below
            self.arm(dbapi)
            try:
                return ping(dbapi)
            finally:
                self.disarm(dbapi)

        engine.dialect.do_ping = do_ping  # this engine's dialect instance only
        connect = self._connect = engine.dialect.connect

        def guarded_connect(*cargs: Any, **cparams: Any) -> Any:
            if (since := self._down_since) is not None:
                self.refused += 1
                self._ensure_probe()  # a forked child inherits the state, not the thread
                raise DatabaseNotAnswering(
                    f"database not answering for {time.monotonic() - since:.1f} s (a deadline passed); "
                    "new connections refused until a probe gets through"
                )
            self._last_connect = (cargs, cparams)
            start = time.monotonic()
            try:
                return connect(*cargs, **cparams)
            except psycopg.OperationalError:
                if time.monotonic() - start >= 1.0:  # ran into connect_timeout; a refusal comes in ms
                    self._mark_down()
                raise

        engine.dialect.connect = guarded_connect
        threading.Thread(target=self._watch, name="db-statement-deadline", daemon=True).start()

    def arm(self, dbapi: Any) -> None:
        if dbapi is None or dbapi.closed:
            return
        with self._lock:
            self._armed[id(dbapi)] = (time.monotonic() + self.seconds, weakref.ref(dbapi))
        self._wake.set()

    def disarm(self, dbapi: Any) -> None:
        if dbapi is None:
            return
        with self._lock:
            self._armed.pop(id(dbapi), None)

    def _watch(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                expired = [key for key, (deadline, _) in self._armed.items() if deadline <= now]
                connections = [self._armed.pop(key)[1]() for key in expired]
                wait = min((d for d, _ in self._armed.values()), default=now + 60) - now
            for dbapi in connections:
                if dbapi is not None and not dbapi.closed and _waiting_on_server(dbapi):
                    self._sever(dbapi.pgconn.socket)
            self.expired += len(connections)  # counted once decided, severed or not
            self._wake.wait(timeout=max(0.01, min(wait, 1.0)))
            self._wake.clear()

    @property
    def answering(self) -> bool:
        """False from a passed deadline until a probe connects again."""
        return self._down_since is None

    def _mark_down(self) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("database not answering: new connections refused until a probe gets through")
        self._ensure_probe()

    def _ensure_probe(self) -> None:
        with self._lock:
            if self._probe is None or not self._probe.is_alive():
                self._probe = threading.Thread(target=self._probe_until_up, name="db-probe", daemon=True)
                self._probe.start()

    def _probe_until_up(self) -> None:
        while self._down_since is not None:
            time.sleep(self.seconds)  # one connect per deadline: a hung server is not flooded
            if self._last_connect is None:
                continue
            cargs, cparams = self._last_connect
            try:
                self._connect(*cargs, **cparams).close()
            except psycopg.OperationalError:
                self.failed_probes += 1
                continue
            log.warning("database answers again after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None

    def _sever(self, fd: int) -> None:
        try:  # a dup, so the driver's own descriptor is never closed under it
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # the statement finished and the connection went meanwhile
        with sock:
            # Counted and marked down before the shutdown wakes the waiting caller: whoever sees its
            # error sees both (counted after, a caller could read the counters first).
            self.severed += 1
            self._mark_down()
            log.warning("database statement exceeded %.1f s: connection closed", self.seconds)
            with contextlib.suppress(OSError):  # already shut by the peer: severed all the same
                sock.shutdown(socket.SHUT_RDWR)
