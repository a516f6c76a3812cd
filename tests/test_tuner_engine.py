"""The tuner on the real engine (tiny models): swap the good draft for a bad
one -> the class goes off and a diagnosis exists; swap back -> probes bring it
back on.  How fast is printed (seconds after each draft serves), not bounded."""

from __future__ import annotations

import httpx
import pytest

from conftest import OPERATOR, VIEWER, CompletionLoad, serve_tiny
from servers import seconds_until, wait_for

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
    """PATCH as a client of optimistic locking does: the tuner writes versions of its own, so a 409
    (its write landed between our read and our write) means read the new ETag and apply again."""

    def applied() -> bool:
        etag = httpx.get(f"{base}/api/v1/policy", headers=VIEWER).headers["ETag"]
        r = httpx.patch(f"{base}/api/v1/policy", json=patch, headers={**OPERATOR, "If-Match": etag}, timeout=120)
        assert r.status_code in (200, 409), r.text
        return r.status_code == 200

    wait_for(applied, 120, f"applying {patch}")


def _qa_decisions(base: str) -> list[dict]:
    decisions = httpx.get(f"{base}/api/v1/decisions", headers=VIEWER).json()
    return [d for d in decisions if d["prompt_class"] == "qa"]


def _qa(base: str) -> dict:
    return httpx.get(f"{base}/api/v1/policy/effective", params={"class": "qa"}, headers=VIEWER).json()


def _serving(base: str, draft) -> bool:
    """Ready, with ``draft`` loaded: the managed rebuild is done (not yet begun reads ready too)."""
    try:
        ready = httpx.get(f"{base}/readyz", timeout=10).json()
    except httpx.HTTPError:
        return False
    return ready["ready"] and ready["draft_model"] == str(draft)


def _until(base: str, predicate, timeout: float, what: str) -> float:
    """``seconds_until``; a failure says what the tuner decided for qa last, and why."""
    try:
        return seconds_until(predicate, timeout, what)
    except pytest.fail.Exception:
        last = [
            (d["action"], d["applied"], d["inputs"].get("acceptance"), d["predicted_speedup"], d["inputs"]["reason"])
            for d in _qa_decisions(base)[:8]
        ]
        pytest.fail(f"{what}: not within {timeout:.0f} s; qa's last decisions (newest first): {last}; now: {_qa(base)}")


def test_bad_draft_switches_the_class_off_and_back_on(tuned, tiny):
    base = tuned
    _patch(base, {"global": {"cooldown_s": INTERVAL, "probe_fraction": 0.5, "draft_cost_prior": 0.2}})
    with CompletionLoad(base, max_tokens=16) as load:
        wait_for(lambda: any(d["inputs"]["acceptance"] for d in _qa_decisions(base)), 120, "a measured qa decision")
        assert _qa(base)["speculation_enabled"]  # a copy draft pays
        _patch(base, {"global": {"draft_model": str(tiny["indep"])}})  # managed rebuild to a bad draft
        wait_for(lambda: _serving(base, tiny["indep"]), 120, "rebuild to the bad draft")
        # Deadlines here only stop a hang: how fast it switches is printed (a shared host is slow).
        took = _until(base, lambda: not _qa(base)["speculation_enabled"], 120, "switching qa off")
        print(f"\nqa off {took:.1f} s after the bad draft came up (interval {INTERVAL:.0f} s)")
        off = next(d for d in _qa_decisions(base) if d["action"] == "off")
        assert off["applied"] and off["inputs"]["acceptance"] < 0.7 and off["predicted_speedup"] < 1
        wait_for(
            lambda: any(
                d["trigger"] == "tuner" for d in httpx.get(f"{base}/api/v1/diagnostics", headers=VIEWER).json()
            ),
            120,
            "a diagnosis",
        )
        _patch(base, {"global": {"draft_model": str(tiny["copy"])}})  # the good draft is back
        wait_for(lambda: _serving(base, tiny["copy"]), 120, "rebuild to the good draft")
        # Only the good draft's probes count (the bad draft's hour of history is another draft's).
        took = _until(base, lambda: _qa(base)["speculation_enabled"], 180, "re-probe switching qa back on")
        print(f"qa back on {took:.1f} s after the good draft came up")
    assert load.failures == []
    audit = httpx.get(f"{base}/api/v1/audit", headers=VIEWER).json()
    assert any(a["actor"] == "tuner" for a in audit)
