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
from typing import Any

from sqlalchemy import Engine, event

log = logging.getLogger(__name__)


class StatementDeadline:
    def __init__(self, engine: Engine, seconds: float) -> None:
        self.seconds = seconds
        self.severed = 0
        self._armed: dict[int, tuple[float, int]] = {}  # id(dbapi connection) -> (deadline, socket fd)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        event.listen(engine, "before_cursor_execute", self._arm)
        event.listen(engine, "after_cursor_execute", self._disarm)
        event.listen(engine, "handle_error", self._on_error)
        threading.Thread(target=self._watch, name="db-statement-deadline", daemon=True).start()

    def _arm(self, conn: Any, *_: Any) -> None:
        dbapi = conn.connection.dbapi_connection
        with self._lock:
            self._armed[id(dbapi)] = (time.monotonic() + self.seconds, dbapi.pgconn.socket)
        self._wake.set()

    def _disarm(self, conn: Any, *_: Any) -> None:
        with self._lock:
            self._armed.pop(id(conn.connection.dbapi_connection), None)

    def _on_error(self, context: Any) -> None:
        if context.connection is not None and context.connection.connection.dbapi_connection is not None:
            self._disarm(context.connection)

    def _watch(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                expired = [key for key, (deadline, _) in self._armed.items() if deadline <= now]
                fds = [self._armed.pop(key)[1] for key in expired]
                wait = min((d for d, _ in self._armed.values()), default=now + 60) - now
            for fd in fds:
                self._sever(fd)
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
