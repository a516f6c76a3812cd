"""Draft diagnosis on the tiny family: a copy draft is accepted at every
position, an independent one nowhere, and the findings say so.  Reports are
stored when triggered from the API and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from spectune.api.auth import Role, TokenSpec
from spectune.app import create_app
from spectune.store.db import make_engine, upgrade
from spectune.store.models import DiagnosticsReport
from spectune.tuner.diagnose import DiagnosisInput, DutyCycle, block_acceptance, findings, run_diagnosis
from spectune.tuner.diagnosis_job import DiagnosisRunner

PROMPTS = [("qa", "the model draft"), ("long", "accept the token " * 8)]


@pytest.fixture(scope="module")
def reports(tiny):
    return {
        name: run_diagnosis(
            DiagnosisInput(
                target=str(tiny["target"]), draft=str(tiny[name]), prompts=PROMPTS, max_new_tokens=24, positions=4
            )
        )
        for name in ("copy", "indep", "noised")
    }


def test_copy_draft_is_accepted_at_every_position(reports):
    for c in reports["copy"]["classes"].values():
        assert all(a > 0.999 for a in c["per_position_expected"])
        assert c["greedy_agreement"] == 1.0 and c["kl"] < 1e-5
    # same weights as the target: the latency ratio is ~1 (timing on a shared CPU: a wide band)
    assert 0.5 < reports["copy"]["latency"]["ratio"] < 2.0


def test_independent_draft_is_accepted_nowhere_and_the_findings_say_so(reports):
    for c in reports["indep"]["classes"].values():
        assert c["greedy_agreement"] < 0.05  # greedy acceptance ~ 0
        assert c["expected_acceptance"] < 0.3 and c["per_position_expected"][1] < 0.1
    assert any("disagrees with the target" in f for f in reports["indep"]["findings"])
    noised = reports["noised"]["classes"]["qa"]
    assert 0.3 < noised["expected_acceptance"] < 0.99  # in between
    assert reports["indep"]["top_disagreements"][0]["expected_acceptance"] < 0.5
    layers = reports["indep"]["attention_entropy"]
    assert len(layers["target"]) == len(layers["draft"]) == 2 and all(e > 0 for e in layers["target"])


def test_duty_cycle_idles_to_its_share():
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pace = DutyCycle(0.25, clock=lambda: now[0], sleep=sleep)
    for work in (1.0, 0.2, 0.0):
        now[0] += work
        pace.pause()
    assert slept == pytest.approx([3.0, 0.6, 0.0])
    assert pace.busy_s / (pace.busy_s + pace.idle_s) == pytest.approx(0.25)
    unthrottled = DutyCycle(1.0, clock=lambda: now[0], sleep=sleep)
    now[0] += 5
    unthrottled.pause()
    assert len(slept) == 3 and unthrottled.busy_s == pytest.approx(5)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="cpu share"):
            DutyCycle(bad)


def test_a_paced_diagnosis_pauses_every_token_and_reports_its_share(tiny, monkeypatch):
    pauses = []
    original = DutyCycle.pause
    monkeypatch.setattr(DutyCycle, "pause", lambda self: (pauses.append(1), original(self)))
    inp = DiagnosisInput(target=str(tiny["target"]), draft=str(tiny["copy"]), prompts=PROMPTS[:1],
                         max_new_tokens=16, positions=4, cpu_share=0.5)  # fmt: skip
    report = run_diagnosis(inp)
    assert len(pauses) >= 16  # one per generated token at least, not one per diagnosis
    cpu = report["cpu"]
    assert cpu["share"] == 0.5 and cpu["busy_s"] > 0 and cpu["idle_s"] == pytest.approx(cpu["busy_s"])


def test_findings_rules():
    base = {
        "latency": {"ratio": 0.3},
        "classes": {
            "qa": {
                "expected_acceptance": 0.8,
                "greedy_agreement": 0.8,
                "per_position_expected": [0.8, 0.6, 0.35, 0.2, 0.1],
                "per_position_realised": [0.4],
            }
        },
    }
    out = findings(base)
    assert any("lower N to 3" in f for f in out) and any("realised first-position" in f for f in out)
    slow = {**base, "latency": {"ratio": 0.72}}
    assert "draft too slow: cost ratio 0.72 > 0.6" in " ".join(findings(slow))
    assert block_acceptance([1.0, 0.5, 0.5], 2) == [pytest.approx(2 / 3), pytest.approx(0.375)]


def _finished_report(api: TestClient, report_id: int, timeout: float = 120) -> dict:
    """Poll GET /diagnostics/{id} until the background diagnosis is no longer running."""
    deadline = time.time() + timeout
    while (row := api.get(f"/api/v1/diagnostics/{report_id}", headers={"Authorization": "Bearer op"}).json())[
        "status"
    ] == "running":
        assert time.time() < deadline, f"diagnosis {report_id} still running after {timeout:.0f} s"
        time.sleep(0.5)
    return row


def test_api_trigger_stores_a_report(tiny, tmp_path):
    url = f"sqlite:///{tmp_path}/d.db"
    upgrade(url)
    db = make_engine(url)
    runner = DiagnosisRunner(db, lambda: (str(tiny["target"]), str(tiny["indep"])))
    tokens = {"ola": TokenSpec(token="op", role=Role.OPERATOR)}
    with TestClient(create_app(None, db, tokens, diagnosis=runner)) as api:
        r = api.post(
            "/api/v1/diagnostics", json={"class": "qa", "max_prompts": 2}, headers={"Authorization": "Bearer op"}
        )
        assert r.status_code == 202
        report_id = r.json()["id"]
        row = _finished_report(api, report_id)
        assert row["status"] == "done" and row["trigger"] == "api" and "disagrees" in row["summary"]
        assert (
            api.post("/api/v1/diagnostics", json={"class": "nope"}, headers={"Authorization": "Bearer op"}).status_code
            == 404
        )
    runner.shutdown()
    with TestClient(create_app(None, db, tokens)) as api:  # no draft configured here
        assert api.post("/api/v1/diagnostics", json={}, headers={"Authorization": "Bearer op"}).status_code == 409


def test_cli_stores_a_report(tiny, tmp_path):
    url = f"sqlite:///{tmp_path}/cli.db"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"class": c, "prompt": p}) for c, p in PROMPTS))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spectune.cli",
            "diagnose",
            "--model",
            str(tiny["target"]),
            "--draft-model",
            str(tiny["copy"]),
            "--prompts-file",
            str(prompts),
            "--db",
            url,
            "--max-new-tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["classes"]["qa"]["greedy_agreement"] == 1.0
    db = make_engine(url)
    with db.connect() as conn:
        row = conn.execute(select(DiagnosticsReport.__table__)).one()
    assert (
        row.trigger == "cli" and row.status == "done" and row.report["classes"]["long"]["expected_acceptance"] > 0.999
    )


def test_a_failing_diagnosis_is_recorded_not_raised(tmp_path):
    url = f"sqlite:///{tmp_path}/f.db"
    upgrade(url)
    db = make_engine(url)
    runner = DiagnosisRunner(db, lambda: (str(tmp_path / "missing-target"), str(tmp_path / "missing-draft")))
    report_id, future = runner.submit("api", None)
    future.result(timeout=60)
    with db.connect() as conn:
        row = conn.execute(select(DiagnosticsReport.__table__).where(DiagnosticsReport.id == report_id)).one()
    assert row.status == "failed" and row.error and row.finished_at is not None
    runner.shutdown()


def test_a_firing_alert_starts_a_linked_diagnosis(tiny, tmp_path):
    url = f"sqlite:///{tmp_path}/a.db"
    upgrade(url)
    db = make_engine(url)
    runner = DiagnosisRunner(db, lambda: (str(tiny["target"]), str(tiny["indep"])))
    tokens = {"ola": TokenSpec(token="op", role=Role.OPERATOR)}
    alert = {
        "status": "firing",
        "labels": {"alertname": "SpecAcceptanceLow", "class": "qa"},
        "startsAt": "2026-11-30T10:00:00Z",
        "fingerprint": "f1",
    }
    payload = {"status": "firing", "alerts": [alert]}
    auth = {"Authorization": "Bearer op"}
    with TestClient(create_app(None, db, tokens, diagnosis=runner)) as api:
        assert api.post("/api/v1/alerts/alertmanager", json=payload, headers=auth).json()["stored"] == 1
        assert api.post("/api/v1/alerts/alertmanager", json=payload, headers=auth).json()["stored"] == 0  # repeat
        (event,) = api.get("/api/v1/alerts", headers=auth).json()
        report_id = event["diagnosis_id"]
        assert report_id is not None
        row = _finished_report(api, report_id)
        assert row["trigger"] == "alert" and row["prompt_class"] == "qa" and row["status"] == "done"
        assert len(api.get("/api/v1/diagnostics", headers=auth).json()) == 1  # repeats start nothing
    runner.shutdown()


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; whoever adopted it reaps it


def test_the_worker_exits_with_a_killed_server(tmp_path):
    """kill -9 of the serving process must not leave a worker holding two models' memory."""
    import os
    import signal

    from servers import wait_for

    script = f"""
import time
from spectune.store.db import make_engine, upgrade
from spectune.tuner.diagnosis_job import DiagnosisRunner
url = "sqlite:///{tmp_path}/d.db"
upgrade(url)
runner = DiagnosisRunner(make_engine(url), lambda: ("{tmp_path}/no-target", "{tmp_path}/no-draft"))
runner.submit("test", None)[1].result(timeout=120)
print(*runner._pool._processes, flush=True)
time.sleep(600)
"""
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    (worker,) = (int(pid) for pid in server.stdout.readline().split())
    assert _alive(worker)
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    wait_for(lambda: not _alive(worker), 60, "the orphaned diagnosis worker exiting", poll=0.1)  # stops a hang


def test_a_diagnosis_that_would_not_fit_in_memory_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    import json

    from spectune.tuner import diagnosis_job
    from spectune.tuner.diagnosis_job import GIB, fp32_bytes, memory_shortfall

    models = {}
    for name, dtype, size in (("target", "bfloat16", 3000), ("draft", "float32", 1000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
        (tmp_path / name / "model.safetensors").write_bytes(b"\0" * size)
        models[name] = str(tmp_path / name)
    assert fp32_bytes(models["target"]) == 6000 and fp32_bytes(models["draft"]) == 1000  # bf16 doubles
    assert fp32_bytes(str(tmp_path / "not-a-model")) is None
    assert memory_shortfall(models["target"], models["draft"], GIB + 7000) is None
    why = memory_shortfall(models["target"], models["draft"], GIB + 6999)
    assert why is not None and "not enough memory" in why and "--no-engine" in why
    url = f"sqlite:///{tmp_path}/m.db"
    upgrade(url)
    db = make_engine(url)
    monkeypatch.setattr(diagnosis_job, "available_memory", lambda: GIB)
    runner = DiagnosisRunner(db, lambda: (models["target"], models["draft"]))
    report_id, future = runner.submit("tuner", "qa")
    assert future.result(timeout=1) == report_id
    with db.connect() as conn:
        row = conn.execute(select(DiagnosticsReport.__table__).where(DiagnosticsReport.id == report_id)).one()
    assert row.status == "failed" and "not enough memory" in row.error
    assert not runner._pool._processes  # no worker was started for it
    runner.shutdown()
