"""Database access: engines, migrations, idempotent bulk inserts.

SQLite (a file) is the embedded default; PostgreSQL
(``postgresql+psycopg://...``) the production store.  Both are migrated by
Alembic from ``alembic/``; nothing calls ``create_all``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, insert
from sqlalchemy.dialects import postgresql, sqlite

from spectune.engine.schema import RequestRecord

from .deadline import StatementDeadline
from .models import Base, RequestRecordRow

ALEMBIC_DIR = Path(__file__).resolve().parent.parent / "alembic"
DEFAULT_URL = "sqlite:///var/spectune.db"


def make_engine(url: str = DEFAULT_URL, *, timeout_s: float | None = None, **kwargs: Any) -> Engine:
    """``timeout_s``: no connect, pool wait or statement takes longer (PostgreSQL; SQLite is a local
    file and waits at most its busy timeout); the caller gets an ``OperationalError`` instead."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
        path = Path(url.removeprefix("sqlite:///"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)  # records are operational data: owner only (SQLite's -wal/-shm copy this mode)
    if timeout_s is not None and url.startswith("postgresql"):
        connect_args = kwargs.setdefault("connect_args", {})
        connect_args.setdefault("connect_timeout", max(1, round(timeout_s)))
        connect_args.setdefault("options", f"-c statement_timeout={int(timeout_s * 1000)}")
        kwargs.setdefault("pool_timeout", timeout_s)
    engine = create_engine(url, **kwargs)
    if timeout_s is not None and engine.dialect.name == "postgresql":
        StatementDeadline(engine, timeout_s + 1)  # the server's own timeout first, when it still answers
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the recorder
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    return engine


def alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(ALEMBIC_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def record_row(fields: dict[str, Any]) -> dict[str, Any]:
    """RequestRecord fields (as dumped) -> a request_records row (converted in place).

    Sampled prompt text never goes into request_records (see ``sampled_prompt_row``)."""
    fields.pop("prompt_text", None)
    fields.pop("completion_text", None)
    for key in ("arrival_time", "first_token_time", "finish_time"):
        fields[key] = utc(fields[key])
    return fields


def insert_ignoring_duplicates(db: Engine | Connection, table: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Bulk INSERT that skips rows whose primary key exists (replays are safe); on a connection,
    inside the caller's transaction."""
    if not rows:
        return
    dialect = db.dialect.name
    if dialect == "postgresql":
        stmt = postgresql.insert(table).on_conflict_do_nothing()
    elif dialect == "sqlite":
        stmt = sqlite.insert(table).on_conflict_do_nothing()
    else:  # pragma: no cover - only the two supported stores
        stmt = insert(table).prefix_with("IGNORE")
    if isinstance(db, Connection):
        db.execute(stmt, list(rows))
        return
    with db.begin() as conn:
        conn.execute(stmt, list(rows))


def insert_records(engine: Engine, records: Iterable[RequestRecord]) -> None:
    insert_ignoring_duplicates(engine, RequestRecordRow.__table__, [record_row(r.model_dump()) for r in records])


__all__ = ["Base", "downgrade", "insert_ignoring_duplicates", "insert_records", "make_engine", "upgrade"]
