"""Control-plane API: auth, optimistic concurrency, validation, history,
rollback, audit, reads.  The control plane runs without an engine here
(``--no-engine`` mode); the end-to-end test with an engine is in
test_api_engine.py."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from spectune.app import create_app
from spectune.store.db import insert_records, make_engine, upgrade

from conftest import OPERATOR, VIEWER, token_specs
from records import make_records

TOKENS = token_specs()


@pytest.fixture
def api(tmp_path):
    url = f"sqlite:///{tmp_path}/cp.db"
    upgrade(url)
    db = make_engine(url)
    with TestClient(create_app(None, db, TOKENS)) as client:
        client.db = db
        yield client
    db.dispose()


def _etag(api) -> str:
    return api.get("/api/v1/policy", headers=VIEWER).headers["ETag"]


WRITES = [
    ("PUT", "/api/v1/policy", {"global": {"num_speculative_tokens": 2}}),
    ("PATCH", "/api/v1/policy", {"global": {"num_speculative_tokens": 2}}),
    ("POST", "/api/v1/policy/rollback", {"version": 1}),
]


@pytest.mark.parametrize("method, path, body", WRITES)
@pytest.mark.parametrize("who, expected", [(None, 401), ("bad", 401), ("viewer", 403), ("operator", 200)])
def test_auth_matrix(api, method, path, body, who, expected):
    headers = {None: {}, "bad": {"Authorization": "Bearer nope"}, "viewer": VIEWER, "operator": OPERATOR}[who]
    response = api.request(method, path, json=body, headers={**headers, "If-Match": _etag(api)})
    assert response.status_code == expected, response.text


def test_reads_need_a_token(api):
    assert api.get("/api/v1/policy").status_code == 401
    assert api.get("/api/v1/policy", headers=VIEWER).status_code == 200
    assert api.get("/api/v1/records", headers={"Authorization": "Basic dmljOnZpZXdlcg=="}).status_code == 401


def test_concurrent_patches_one_wins(api):
    etag = _etag(api)
    results = []

    def patch(n):
        results.append(
            api.patch(
                "/api/v1/policy", json={"global": {"num_speculative_tokens": n}}, headers={**OPERATOR, "If-Match": etag}
            ).status_code
        )

    threads = [threading.Thread(target=patch, args=(n,)) for n in (2, 4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(results) == [200, 409]
    history = api.get("/api/v1/policy/versions", headers=VIEWER).json()
    assert [v["version"] for v in history] == [2, 1]  # exactly one change
    missing = api.patch("/api/v1/policy", json={}, headers=OPERATOR)  # If-Match is required
    assert missing.status_code == 428 and "if-match" in missing.text.lower()


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"global": {"num_speculative_tokens": -1}}, "num_speculative_tokens"),
        ({"global": {"num_speculative_tokens": 9}}, "num_speculative_tokens"),  # > n_max 6
        ({"global": {"acceptance_floor": 1.5}}, "acceptance_floor"),
        (
            {
                "global": {
                    "batch_table": [
                        {"min_batch": 1, "max_batch": 8, "num_speculative_tokens": 3},
                        {"min_batch": 4, "max_batch": 16, "num_speculative_tokens": 1},
                    ]
                }
            },
            "overlap",
        ),
        ({"global": {"n_min": 5, "n_max": 2}}, "n_min"),
        ({"global": {"bogus": 1}}, "bogus"),
        ({"classes": {"nope": {"num_speculative_tokens": 1}}}, "unknown prompt class"),
        ({"classes": {"qa": {"tuner_mode": "sometimes"}}}, "tuner_mode"),
        ({"global": {"disable_below_batch": 8, "disable_above_batch": 4}}, "disable_below_batch"),
    ],
)
def test_bad_policies_get_422_naming_the_field(api, patch, field):
    response = api.patch("/api/v1/policy", json=patch, headers={**OPERATOR, "If-Match": _etag(api)})
    assert response.status_code == 422
    assert field in response.text
    assert api.get("/api/v1/policy", headers=VIEWER).json()["version"] == 1  # nothing was written


def test_history_diff_rollback_and_audit(api):
    r = api.patch(
        "/api/v1/policy",
        json={"classes": {"qa": {"num_speculative_tokens": 1}}},
        headers={**OPERATOR, "If-Match": _etag(api), "X-Change-Reason": "qa drafts are wasted"},
    )
    assert r.status_code == 200 and r.headers["ETag"] == '"2"'
    diff = api.get("/api/v1/policy/diff", params={"from": 1, "to": 2}, headers=VIEWER).json()["changes"]
    assert diff == [{"path": "/classes/qa/num_speculative_tokens", "before": None, "after": 1}]
    eff = api.get("/api/v1/policy/effective", params={"class": "qa"}, headers=VIEWER).json()
    assert eff["num_speculative_tokens"] == 1
    r = api.post("/api/v1/policy/rollback", json={"version": 1}, headers={**OPERATOR, "If-Match": '"2"'})
    assert r.status_code == 200 and r.json()["version"] == 3 and "qa" not in r.json()["policy"].get("classes", {})
    audit = api.get("/api/v1/audit", headers=VIEWER).json()
    assert [a["action"] for a in audit] == ["rollback", "patch", "create"]
    assert audit[1]["actor"] == "ola" and audit[1]["reason"] == "qa drafts are wasted"
    assert audit[0]["diff"]["changes"][0]["path"] == "/classes/qa/num_speculative_tokens"
    assert api.get("/api/v1/policy/versions/99", headers=VIEWER).status_code == 404


def test_remote_engines_poll_with_etag(api):
    r = api.get("/api/v1/engines/gpu-7/settings", headers=VIEWER)
    assert r.status_code == 200 and r.json()["version"] == 1
    assert (
        api.get("/api/v1/engines/gpu-7/settings", headers={**VIEWER, "If-None-Match": r.headers["ETag"]}).status_code
        == 304
    )
    api.patch(
        "/api/v1/policy",
        json={"instances": {"gpu-7": {"disable_above_batch": 32}}},
        headers={**OPERATOR, "If-Match": r.headers["ETag"]},
    )
    r2 = api.get("/api/v1/engines/gpu-7/settings", headers={**VIEWER, "If-None-Match": r.headers["ETag"]})
    assert r2.status_code == 200 and r2.json()["version"] == 2
    table = r2.json()["batch_table"]
    assert {"min_batch": 33, "max_batch": 4096, "num_speculative_tokens": 0} in table


def test_records_pagination_and_stats(api):
    records = make_records(250)
    insert_records(api.db, records)
    seen, cursor = [], None
    while True:
        page = api.get(
            "/api/v1/records", params={"limit": 100, **({"cursor": cursor} if cursor else {})}, headers=VIEWER
        ).json()
        seen += [r["request_id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(seen) == sorted(r.request_id for r in records) and len(seen) == 250
    qa = api.get("/api/v1/records", params={"class": "qa", "limit": 1000}, headers=VIEWER).json()["items"]
    assert qa and all(r["prompt_class"] == "qa" for r in qa)
    stats = api.get(
        "/api/v1/stats/acceptance", params={"window_s": 3600, "group_by": "position"}, headers=VIEWER
    ).json()
    by_class = {g["class"]: g for g in stats["groups"]}
    expected_qa = [r for r in records if r.prompt_class == "qa"]
    assert by_class["qa"]["accepted"] == sum(r.num_accepted_tokens for r in expected_qa)
    assert [p["accepted"] for p in by_class["qa"]["positions"]] == [
        sum(r.accepted_per_position[i] for r in expected_qa) for i in range(4)
    ]
    lat = api.get("/api/v1/stats/latency", params={"window_s": 3600}, headers=VIEWER).json()
    assert {c["class"] for c in lat["classes"]} == {"qa", "long"} and lat["classes"][0]["e2e_s"]["p50"] == 1.0
    assert api.get("/api/v1/records", params={"cursor": "garbage"}, headers=VIEWER).status_code == 422
    assert api.get("/api/v1/records", params={"class": "nope"}, headers=VIEWER).status_code == 404
    assert api.get("/api/v1/stats/acceptance", params={"window_s": -1}, headers=VIEWER).status_code == 422


def test_alertmanager_webhook_is_idempotent(api):
    alert = {
        "status": "firing",
        "labels": {"alertname": "SpecAcceptanceLow", "class": "qa"},
        "annotations": {"summary": "acceptance < 70% for 5m"},
        "startsAt": "2026-11-30T10:00:00Z",
        "fingerprint": "abc123",
    }
    payload = {"version": "4", "status": "firing", "receiver": "spectune", "alerts": [alert]}
    assert api.post("/api/v1/alerts/alertmanager", json=payload, headers=VIEWER).status_code == 403
    assert api.post("/api/v1/alerts/alertmanager", json=payload, headers=OPERATOR).json() == {
        "received": 1,
        "stored": 1,
    }
    assert api.post("/api/v1/alerts/alertmanager", json=payload, headers=OPERATOR).json()["stored"] == 0  # repeat
    resolved = {**payload, "status": "resolved", "alerts": [{**alert, "status": "resolved"}]}
    assert api.post("/api/v1/alerts/alertmanager", json=resolved, headers=OPERATOR).json()["stored"] == 1
    events = api.get("/api/v1/alerts", headers=VIEWER).json()
    assert [(e["alertname"], e["status"]) for e in events] == [
        ("SpecAcceptanceLow", "resolved"),
        ("SpecAcceptanceLow", "firing"),
    ]
    bad = api.post("/api/v1/alerts/alertmanager", json={"status": "weird", "alerts": []}, headers=OPERATOR)
    assert bad.status_code == 422 and "status" in bad.text
