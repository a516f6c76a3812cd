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
