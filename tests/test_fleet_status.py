"""The control plane shows which instance holds which settings version and flags stragglers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from spectune.api.auth import TokenSpec
from spectune.app import create_app
from spectune.store.db import make_engine, upgrade
from spectune.store.instances import fleet, heartbeat
from spectune.store.metrics import FleetCollector

from conftest import OPERATOR, VIEWER, token_specs


def test_instances_report_their_version_and_stragglers_are_flagged(tmp_path):
    url = f"sqlite:///{tmp_path}/cp.db"
    upgrade(url)
    db = make_engine(url)
    start = datetime.now(UTC) - timedelta(minutes=5)
    for name, version in (("e1", 4), ("e2", 4), ("e3", 3)):
        heartbeat(db, name, "target", "draft_model", 6, start, None, version, "/models/draft")
    old = datetime.now(UTC) - timedelta(minutes=2)
    rows = {r["instance_id"]: r for r in fleet(db, 4, old)}
    assert [n for n, r in rows.items() if r["behind"]] == ["e3"] and rows["e1"]["draft_model"] == "/models/draft"
    assert not any(r["behind"] for r in fleet(db, 4, datetime.now(UTC)))  # just changed: still propagating
    registry = CollectorRegistry()
    registry.register(FleetCollector(lambda: fleet(db, 4, old)))
    assert registry.get_sample_value("spectune_instances_behind") == 1
    assert registry.get_sample_value("spectune_instances_live") == 3
    with TestClient(create_app(None, db, token_specs())) as api:
        body = api.get("/api/v1/instances", headers=VIEWER).json()
        assert body["policy_version"] == 1 and {r["instance_id"] for r in body["instances"]} == {"e1", "e2", "e3"}
        assert {r["settings_version"] for r in body["instances"]} == {3, 4}
    db.dispose()


def test_the_rebuild_slot_is_for_engines_and_operators_only(tmp_path):
    url = f"sqlite:///{tmp_path}/cp.db"
    upgrade(url)
    db = make_engine(url)
    tokens = {**token_specs(), "e1": TokenSpec(token="engine-token", role="engine")}
    engine_token = {"Authorization": "Bearer engine-token"}
    with TestClient(create_app(None, db, tokens)) as api:
        slot = "/api/v1/engines/e1/rebuild-slot"
        # A viewer could otherwise hold every rolling change for the slot's ten minutes.
        assert api.post(slot, headers=VIEWER).status_code == 403
        assert api.delete(slot, headers=VIEWER).status_code == 403
        assert api.post(slot, headers=engine_token).json()["holder"] == "e1"
        refused = api.post("/api/v1/engines/e2/rebuild-slot", headers=OPERATOR)
        assert refused.status_code == 409 and "'e1'" in refused.json()["detail"]
        assert api.get("/api/v1/instances", headers=engine_token).json()["rebuilding"] == "e1"
        assert api.patch("/api/v1/policy", json={}, headers=engine_token).status_code == 403  # no writes
        assert api.delete(slot, headers=engine_token).status_code == 204
        assert api.get("/api/v1/instances", headers=VIEWER).json()["rebuilding"] is None
    db.dispose()
