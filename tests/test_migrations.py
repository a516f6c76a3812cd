"""Models and Alembic migrations agree, and migrations go both ways, on
SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, inspect

from spectune.store.db import downgrade, make_engine, upgrade
from spectune.store.models import Base


def _diff(url: str, metadata: MetaData) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(context, metadata)
    finally:
        engine.dispose()


def test_models_match_migrations(db_url):
    upgrade(db_url)
    assert _diff(db_url, Base.metadata) == []


def test_a_model_change_without_migration_is_caught(db_url):
    upgrade(db_url)
    changed = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(changed)
    changed.tables["request_records"].append_column(Column("new_field", Integer))
    diff = _diff(db_url, changed)
    assert [(d[0], d[3].name) for d in diff if d[0] == "add_column"] == [("add_column", "new_field")]


def test_upgrade_downgrade_upgrade(db_url):
    upgrade(db_url)
    downgrade(db_url, "base")
    engine = make_engine(db_url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade(db_url)
    engine = make_engine(db_url)
    assert {"request_records", "step_stats", "policies", "tuner_decisions"} <= set(inspect(engine).get_table_names())
    engine.dispose()
