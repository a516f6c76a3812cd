"""Models and Alembic migrations agree, and migrations go both ways, on
SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, inspect, select

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


def test_stored_policies_are_renamed_to_probe_fraction_and_back(db_url):
    """0009: every stored policy version (rollback reads old ones) takes the engine's name for the
    probe share, in the global policy and every override; downgrade gives the old name back."""
    from datetime import UTC, datetime

    from spectune.tuner.policy import PolicyDocument

    old = {
        "global": {"exploration_fraction": 0.05, "num_speculative_tokens": 3},
        "classes": {"qa": {"exploration_fraction": 0.5}, "long": {"n_max": 4}},
        "instances": {"engine-1": {"exploration_fraction": 0.0}},
    }
    new = {
        "global": {"probe_fraction": 0.05, "num_speculative_tokens": 3},
        "classes": {"qa": {"probe_fraction": 0.5}, "long": {"n_max": 4}},
        "instances": {"engine-1": {"probe_fraction": 0.0}},
    }
    upgrade(db_url, "0008")
    engine = make_engine(db_url)
    now = datetime(2026, 12, 1, tzinfo=UTC)
    meta = MetaData()
    meta.reflect(engine, only=["policies", "policy_versions"])
    policies, versions = meta.tables["policies"], meta.tables["policy_versions"]
    with engine.begin() as conn:
        conn.execute(policies.insert().values(scope="default", version=2, body=old, updated_at=now, updated_by="t"))
        conn.execute(versions.insert(), [
            {"scope": "default", "version": 1, "body": {"global": {}}, "created_at": now, "created_by": "t"},
            {"scope": "default", "version": 2, "body": old, "created_at": now, "created_by": "t"},
        ])  # fmt: skip

    def bodies() -> list:
        with engine.connect() as conn:
            current = conn.execute(select(policies.c.body)).scalar_one()
            return [current, *conn.execute(select(versions.c.body).order_by(versions.c.version)).scalars()]

    upgrade(db_url)
    assert bodies() == [new, {"global": {}}, new]
    assert PolicyDocument.model_validate(bodies()[0]).global_.probe_fraction == 0.05
    downgrade(db_url, "0008")
    assert bodies() == [old, {"global": {}}, old]
    engine.dispose()
