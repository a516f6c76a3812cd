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
        time.sleep(1.5)
        r = httpx.post(
            f"{base}/api/v1/policy/rollback",
            json={"version": start_version},
            headers={**OPERATOR, "If-Match": f'"{start_version + 1}"'},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        rolled_at = time.time()
        time.sleep(1.5)
    time.sleep(0.5)
    assert load.failures == []
    # Requests that ran entirely under N=1 (one still running at the rollback drafts 3 from then on).
    during = [
        r for r in _records_since(base, changed_at, "qa") if changed_at < r["arrival"] and r["finish"] < rolled_at
    ]
    after = [r for r in _records_since(base, rolled_at, "qa") if r["arrival"] > rolled_at]
    assert during and all(
        r["num_speculative_tokens"] == 1 and r["settings_version"] == start_version + 1 for r in during
    )
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
