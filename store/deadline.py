"""A client-side deadline for every database statement.

A PostgreSQL server that hangs (stopped, or a network partition) keeps its TCP
connections open: the kernel still acknowledges, so neither ``statement_timeout``
(server side) nor TCP keepalives end a blocked read, and the caller waits forever.
``StatementDeadline`` arms a deadline before each statement and, when it passes,
shuts the connection's socket down: the blocked driver call fails at once with an
``OperationalError``, SQLAlchemy discards the connection, and the caller sees an
ordinary "database unavailable" error.  One watcher thread serves every connection.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)


def _dbapi(conn: Any) -> Any:
    """The driver connection under a SQLAlchemy one; None once it was invalidated (nothing to watch)."""
    try:
        return None if conn is None else conn.connection.dbapi_connection
    except SQLAlchemyError:
        return None


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
        event.listen(engine, "before_cursor_execute", lambda conn, *_: self.arm(_dbapi(conn)))
        event.listen(engine, "after_cursor_execute", lambda conn, *_: self.disarm(_dbapi(conn)))
        event.listen(engine, "commit", lambda conn: self.arm(_dbapi(conn)))
        event.listen(engine, "rollback", lambda conn: self.arm(_dbapi(conn)))
        event.listen(engine, "handle_error", lambda context: self.disarm(_dbapi(context.connection)))
        event.listen(engine.pool, "reset", lambda dbapi, *_: self.arm(dbapi))
        event.listen(engine.pool, "checkin", lambda dbapi, *_: self.disarm(dbapi))
        ping = engine.dialect.do_ping

        def do_ping(dbapi: Any) -> bool:  # the pool's pre-ping bypasses statement events
            self.arm(dbapi)
            try:
                return ping(dbapi)
            finally:
                self.disarm(dbapi)

        engine.dialect.do_ping = do_ping  # this engine's dialect instance only
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
                if dbapi is not None and not dbapi.closed:
                    self._sever(dbapi.pgconn.socket)
            self._wake.wait(timeout=max(0.01, min(wait, 1.0)))
            self._wake.clear()

    def _sever(self, fd: int) -> None:
        try:  # a dup, so the driver's own descriptor is never closed under it
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            self.severed += 1
            log.warning("database statement exceeded %.1f s: connection closed", self.seconds)
        except OSError:
            pass  # the statement finished and the connection went meanwhile
