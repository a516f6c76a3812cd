"""The replay benchmark as a regression test: the real tuner on the calibrated
simulator must keep meeting the issue's criteria (about 2 s per seed)."""

from __future__ import annotations

import pytest

from benchmarks.tuner_replay import replay
from benchmarks.tuner_replay.report import summarise


@pytest.mark.parametrize("seed", [1, 2])
def test_tuner_meets_the_replay_criteria(seed):
    result = replay.run(phase_minutes=20, seed=seed, interval_s=60)
    lines, criteria = summarise(result, 20)
    assert all(criteria.values()), "\n".join(lines)
    assert lines[0].startswith("**SIMULATED, CALIBRATED.**")  # the report says what it is
    assert {d["action"] for d in result["decisions"] if d["applied"]} >= {"cost_probe", "explore"}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_on_a_drifting_machine_control_requests_keep_every_phase_at_the_n0_arm_or_better(seed):
    """The machine's speed moves by the minute (lognormal sigma 0.3, the same for every arm).  With
    control requests (budget 2 %) the tuner's decisions rest on paired minutes and the guard, and no
    phase falls below the simulator's static N=0 arm; without them seed 2's batch-8 phase ran at
    0.89x of it (a cost timed in a fast minute against one in a slow one).  That arm is the
    calibration's N=0 (measured before the free off state: 0.74-0.77x of plain serving, README),
    not plain serving: these ratios compare tuner policies, they are no speedup over plain."""
    result = replay.run(phase_minutes=20, seed=seed, interval_s=60, drift_sigma=0.3, control_budget=0.02)
    lines, _ = summarise(result, 20)
    base, tuned = result["static"][0], result["tuned"]
    ratios = [t.tok_s / b.tok_s for t, b in zip(tuned, base)]
    assert min(ratios) >= 0.97, "\n".join(lines)
    whole = sum(t.tokens for t in tuned) / sum(t.seconds for t in tuned)
    assert whole / (sum(b.tokens for b in base) / sum(b.seconds for b in base)) >= 1.1, "\n".join(lines)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_on_a_slow_machine_at_live_run_settings_explorations_are_measured_and_no_phase_loses(seed):
    """The live run's settings (10 s interval, 60 s window, 30 s cooldown, drift, budget 2 %) on a
    machine 3.5x slower than calibrated (this one since 2026-12-07): an interval holds a few steps.
    Deciding again one interval after an exploration, the tuner dropped explored N unmeasured and
    explored them again, and seeds 2 and 4 lost 9 % and 12 % in a phase against the N=0 arm; held
    until measured (``decide.exploring``), no phase falls below 0.97x of it."""
    result = replay.run(phase_minutes=5, seed=seed, interval_s=10, drift_sigma=0.3, control_budget=0.02,
                        window_s=60, cooldown_s=30, slower=3.5)  # fmt: skip
    lines, _ = summarise(result, 5)
    ratios = [t.tok_s / b.tok_s for t, b in zip(result["tuned"], result["static"][0])]
    assert min(ratios) >= 0.97, "\n".join(lines)
    assert any(d["inputs"]["reason"].startswith("exploring N=") for d in result["decisions"])
    assert "every step 3.5x as long as calibrated" in "\n".join(lines[:4])  # the report says so
