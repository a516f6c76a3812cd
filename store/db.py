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

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite

from spectune.engine.schema import RequestRecord

from .deadline import StatementDeadline
from .models import Base, StepStat

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


def conflict_insert(db: Engine | Connection, table: Any) -> Any:
    """An INSERT that takes ON CONFLICT clauses, in the dialect of ``db`` (the two supported stores)."""
    dialects = {"postgresql": postgresql, "sqlite": sqlite}
    if db.dialect.name not in dialects:  # pragma: no cover - make_engine builds only these
        raise ValueError(f"unsupported database {db.dialect.name!r}: PostgreSQL or SQLite")
    return dialects[db.dialect.name].insert(table)


def insert_ignoring_duplicates(db: Engine | Connection, table: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Bulk INSERT that skips rows whose primary key exists (replays are safe); on a connection,
    inside the caller's transaction."""
    if not rows:
        return
    stmt = conflict_insert(db, table).on_conflict_do_nothing()
    if isinstance(db, Connection):
        db.execute(stmt, list(rows))
        return
    with db.begin() as conn:
        conn.execute(stmt, list(rows))


def _step_count(row: dict[str, Any]) -> int:
    return row["steps"] + row.get("prefill_steps", 0)


def upsert_step_stats(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Insert step-statistics rows; a row for a key that exists replaces it when it counts at least as
    many steps, prefill steps included (a newer snapshot of the same writer's open minute), so a
    replayed older snapshot is a no-op and totals never go backwards."""
    if not rows:
        return
    keys = [c.name for c in StepStat.__table__.primary_key.columns]
    newest: dict[tuple, dict[str, Any]] = {}
    for row in rows:  # one statement may not touch a row twice (PostgreSQL refuses): keep the newest
        key = tuple(row[k] for k in keys)
        if key not in newest or _step_count(row) >= _step_count(newest[key]):
            newest[key] = row
    rows = list(newest.values())
    stmt, table = conflict_insert(conn, StepStat), StepStat.__table__
    values = {c.name: stmt.excluded[c.name] for c in StepStat.__table__.columns if c.name not in keys}
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=keys,
            set_=values,
            where=stmt.excluded.steps + stmt.excluded.prefill_steps >= table.c.steps + table.c.prefill_steps,
        ),
        rows,
    )


def insert_records(engine: Engine, records: Iterable[RequestRecord]) -> int:
    """Store engine records (and their sums) in one transaction; returns how many were new."""
    from .sums import insert_new_records  # it builds on conflict_insert above

    with engine.begin() as conn:
        return insert_new_records(conn, [record_row(r.model_dump()) for r in records])


__all__ = [
    "Base",
    "conflict_insert",
    "downgrade",
    "insert_ignoring_duplicates",
    "insert_records",
    "make_engine",
    "upgrade",
    "upsert_step_stats",
]
