"""End to end: an operator changes N for a class through the API while
requests run; the engine obeys at once; rollback restores it."""

from __future__ import annotations

import time

import httpx

from conftest import OPERATOR, VIEWER, CompletionLoad


def _records_since(base: str, since: float, prompt_class: str) -> list[dict]:
    from datetime import UTC, datetime

    items = httpx.get(
        f"{base}/api/v1/records",
        headers=VIEWER,
        timeout=30,
        params={"class": prompt_class, "limit": 1000, "since": datetime.fromtimestamp(since, UTC).isoformat()},
    ).json()["items"]
    for item in items:
        item["arrival"] = datetime.fromisoformat(item["arrival_time"]).timestamp()
        item["finish"] = datetime.fromisoformat(item["finish_time"]).timestamp()
    return items


def _await_qa_requests_arriving_after(base: str, since: float, timeout: float = 60) -> None:
    """Poll until two qa requests that arrived after `since` have finished and been recorded (a
    fixed wait was too short on a slow CI machine: no request fit in it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r["arrival"] > since for r in _records_since(base, since, "qa")) >= 2:
            return
        time.sleep(0.2)
    raise AssertionError(f"no two qa requests arriving after {since} were recorded within {timeout:.0f} s")


def test_change_n_for_a_class_while_serving_then_roll_back(served):
    base = served.base
    with CompletionLoad(base) as load:
        current = httpx.get(f"{base}/api/v1/policy", headers=VIEWER).json()
        start_version = current["version"]
        t0 = time.time()
        r = httpx.patch(
            f"{base}/api/v1/policy",
            json={"classes": {"qa": {"num_speculative_tokens": 1}}},
            headers={**OPERATOR, "If-Match": f'"{start_version}"', "X-Change-Reason": "e2e"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        changed_at = time.time()
        assert httpx.get(f"{base}/readyz").json()["settings_version"] == start_version + 1
        print(f"\npolicy PATCH -> engine holds it: {(changed_at - t0) * 1000:.0f} ms")
        _await_qa_requests_arriving_after(base, changed_at)
        rollback_sent = time.time()  # the engine holds the rollback before its response arrives
        r = httpx.post(
            f"{base}/api/v1/policy/rollback",
            json={"version": start_version},
            headers={**OPERATOR, "If-Match": f'"{start_version + 1}"'},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        rolled_at = time.time()
        _await_qa_requests_arriving_after(base, rolled_at)
    assert load.failures == []
    # Requests that ran entirely under N=1 (one still running at the rollback drafts 3 from then on).
    during = [
        r for r in _records_since(base, changed_at, "qa") if changed_at < r["arrival"] and r["finish"] < rollback_sent
    ]
    after = [r for r in _records_since(base, rolled_at, "qa") if r["arrival"] > rolled_at]
    wrong = [
        (round(r["arrival"] - changed_at, 3), round(r["finish"] - rollback_sent, 3), r["num_speculative_tokens"],
         r["settings_version"], r["request_id"])
        for r in during
        if r["num_speculative_tokens"] != 1 or r["settings_version"] != start_version + 1
    ]  # fmt: skip
    shown = "(arrival - changed, finish - rollback sent, N, version)"
    assert during and not wrong, f"v{start_version + 1} expected {shown}: {wrong}"
    assert all(max(r["drafted_per_position"][1:] or [0]) == 0 for r in during)
    assert after and all(r["num_speculative_tokens"] == 3 and r["settings_version"] == start_version + 2 for r in after)


def test_policy_beyond_engine_capacity_is_refused(served):
    etag = httpx.get(f"{served.base}/api/v1/policy", headers=VIEWER).headers["ETag"]
    r = httpx.patch(
        f"{served.base}/api/v1/policy",
        json={"global": {"n_max": 8, "num_speculative_tokens": 8}},
        headers={**OPERATOR, "If-Match": etag},
    )
    assert r.status_code == 422 and "capacity" in r.text


def test_policy_cli(served):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, SPECTUNE_URL=served.base, SPECTUNE_API_TOKEN="operator-token")

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "spectune.cli", "policy", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    before = json.loads(run("get").stdout)["version"]
    out = run("set", "--class", "long", "num_speculative_tokens=2", "--reason", "cli test")
    assert out.returncode == 0 and f"version {before + 1}" in out.stderr
    assert json.loads(run("get", "--class", "long").stdout)["num_speculative_tokens"] == 2
    bad = run("set", "num_speculative_tokens=-3")
    assert bad.returncode == 1 and "num_speculative_tokens" in bad.stderr
    assert "cli test" in run("history").stdout
    assert run("rollback", str(before)).returncode == 0
    assert json.loads(run("get", "--class", "long").stdout)["num_speculative_tokens"] == 3


def test_the_policys_classifier_classifies_what_the_engine_serves(served):
    base = served.base
    etag = httpx.get(f"{base}/api/v1/policy", headers=VIEWER).headers["ETag"]
    classifier = {
        "regex_rules": [{"pattern": "^Rewrite", "prompt_class": "code_edit"}],
        "length_rules": [{"max_prompt_tokens": 30, "prompt_class": "qa"}],
        "default_class": "long",
    }
    r = httpx.patch(
        f"{base}/api/v1/policy",
        json={"classifier": classifier, "classes": {"code_edit": {"num_speculative_tokens": 2}}},
        headers={**OPERATOR, "If-Match": etag},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    since = time.time()
    for prompt in ("Rewrite verify decode accept", "verify decode accept"):
        done = httpx.post(
            f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8}, timeout=60
        )
        assert done.status_code == 200, done.text
    # an explicit class the policy's classifier defines is accepted, one it does not is a 400
    explicit = {"model": model, "prompt": "x", "max_tokens": 2, "spectune_class": "code_edit"}
    assert httpx.post(f"{base}/v1/completions", json=explicit, timeout=60).status_code == 200
    unknown = httpx.post(f"{base}/v1/completions", json={**explicit, "spectune_class": "nope"}, timeout=60)
    assert unknown.status_code == 400 and "code_edit" in unknown.text
    deadline = time.time() + 30  # records reach the database through the recorder's shipper
    while len(edits := _records_since(base, since, "code_edit")) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert len(edits) == 2 and all(r["num_speculative_tokens"] == 2 for r in edits)
    assert [r["prompt_class"] for r in _records_since(base, since, "qa")] == ["qa"]
    # back to the engine's own classifier (merge patch: null removes): the class is gone again
    etag = httpx.get(f"{base}/api/v1/policy", headers=VIEWER).headers["ETag"]
    back = {"classifier": None, "classes": {"code_edit": None}}
    assert httpx.patch(f"{base}/api/v1/policy", json=back, headers={**OPERATOR, "If-Match": etag}).status_code == 200
    assert httpx.post(f"{base}/v1/completions", json=explicit, timeout=60).status_code == 400


def test_an_audited_request_is_replayed_plain_and_its_client_sees_no_logprobs(served):
    base = served.base
    etag = httpx.get(f"{base}/api/v1/policy", headers=VIEWER).headers["ETag"]
    every = {"global": {"fidelity_audit_fraction": 1.0}}
    r = httpx.patch(f"{base}/api/v1/policy", json=every, headers={**OPERATOR, "If-Match": etag}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        body = {"model": "target", "prompt": "fidelity audit probe", "max_tokens": 16, "temperature": 0}
        done = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert done.status_code == 200, done.text
        answer = done.json()
        assert answer["choices"][0]["logprobs"] is None  # the audit's top-2 stay inside
        record_id = answer["id"]
        deadline = time.time() + 60  # the replay runs after the answer, then the recorder ships
        while record_id not in (checks := _checked(served.db)) and time.time() < deadline:
            time.sleep(0.2)
        assert checks.get(record_id) == ("match", 16), checks  # fp32, copy draft: token for token
        found = httpx.get(f"{base}/api/v1/fidelity", params={"window_s": 600}, headers=VIEWER).json()
        assert sum(c["match"] for c in found["classes"]) >= 1 and not any(c["defect"] for c in found["classes"])
    finally:
        etag = httpx.get(f"{base}/api/v1/policy", headers=VIEWER).headers["ETag"]
        back = {"global": {"fidelity_audit_fraction": None}}
        assert (
            httpx.patch(f"{base}/api/v1/policy", json=back, headers={**OPERATOR, "If-Match": etag}).status_code == 200
        )


def _checked(db_url: str) -> dict[str, tuple[str, int]]:
    from sqlalchemy import select

    from spectune.store.db import make_engine
    from spectune.store.models import FidelityCheck

    db = make_engine(db_url)
    try:
        with db.connect() as conn:
            rows = conn.execute(select(FidelityCheck.request_id, FidelityCheck.result, FidelityCheck.compared_tokens))
            return {row.request_id: (row.result, row.compared_tokens) for row in rows}
    finally:
        db.dispose()
