"""The tuner on the real engine (tiny models): swap the good draft for a bad
one -> within two intervals the class is off and a diagnosis exists; swap
back -> probes bring it back on."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import OPERATOR, VIEWER, CompletionLoad, serve_tiny

INTERVAL = 3.0


@pytest.fixture(scope="module")
def tuned(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("tuned")
    proc, base = serve_tiny(
        tiny,
        root,
        "--db",
        f"sqlite:///{root}/t.db",
        SPECTUNE_TUNER_INTERVAL_S=str(INTERVAL),
        SPECTUNE_TUNER_WINDOW_S=str(INTERVAL),
    )
    yield base
    proc.terminate()
    proc.wait(timeout=60)


def _patch(base: str, patch: dict) -> None:
    etag = httpx.get(f"{base}/api/v1/policy", headers=VIEWER).headers["ETag"]
    r = httpx.patch(f"{base}/api/v1/policy", json=patch, headers={**OPERATOR, "If-Match": etag}, timeout=120)
    assert r.status_code == 200, r.text


def _qa(base: str) -> dict:
    return httpx.get(f"{base}/api/v1/policy/effective", params={"class": "qa"}, headers=VIEWER).json()


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.time()
    while not predicate():
        assert time.time() - start < timeout, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.5)
    return time.time() - start


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).json()["ready"]
    except httpx.HTTPError:
        return False


def test_bad_draft_switches_the_class_off_and_back_on(tuned, tiny):
    base = tuned
    _patch(base, {"global": {"cooldown_s": INTERVAL, "exploration_fraction": 0.5, "draft_cost_prior": 0.2}})
    with CompletionLoad(base, max_tokens=16) as load:
        time.sleep(2 * INTERVAL)
        assert _qa(base)["speculation_enabled"]  # a copy draft pays
        _patch(base, {"global": {"draft_model": str(tiny["indep"])}})  # managed rebuild to a bad draft
        _wait(lambda: _ready(base), 120, "rebuild to the bad draft")
        took = _wait(lambda: not _qa(base)["speculation_enabled"], 2 * INTERVAL + 4, "switching qa off")
        print(f"\nqa off {took:.1f} s after the bad draft came up (interval {INTERVAL:.0f} s)")
        decisions = httpx.get(f"{base}/api/v1/decisions", headers=VIEWER).json()
        off = next(d for d in decisions if d["action"] == "off" and d["prompt_class"] == "qa")
        assert off["applied"] and off["inputs"]["acceptance"] < 0.7 and off["predicted_speedup"] < 1
        _wait(
            lambda: any(
                d["trigger"] == "tuner" for d in httpx.get(f"{base}/api/v1/diagnostics", headers=VIEWER).json()
            ),
            30,
            "a diagnosis",
        )
        _patch(base, {"global": {"draft_model": str(tiny["copy"])}})  # the good draft is back
        _wait(lambda: _ready(base), 120, "rebuild to the good draft")
        took = _wait(lambda: _qa(base)["speculation_enabled"], 6 * INTERVAL, "re-probe switching qa back on")
        print(f"qa back on {took:.1f} s after the good draft came up")
    assert load.failures == []
    audit = httpx.get(f"{base}/api/v1/audit", headers=VIEWER).json()
    assert any(a["actor"] == "tuner" for a in audit)
