"""The tuner job against a real database: modes, cooldown, audit, diagnosis."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.policies import PolicyRepository
from spectune.tuner.job import Tuner
from spectune.tuner.policy import Policy, PolicyDocument

from records import make_records


def _qa_records(n: int, drafted: list[int], accepted: list[int], at: float | None = None, prefix: str | None = None):
    """n qa records that all drafted / accepted these counts per position, finished at ``at`` (now)."""
    update = {
        "prompt_class": "qa",
        "drafted_per_position": drafted,
        "accepted_per_position": accepted,
        "num_draft_tokens": sum(drafted),
        "num_accepted_tokens": sum(accepted),
        "num_spec_steps": drafted[0],
        "finish_time": time.time() if at is None else at,
    }
    return [r.model_copy(update=update) for r in make_records(n, prefix=prefix or f"qa{time.time_ns()}")]


def _bad_records(n: int):
    return _qa_records(n, [3, 3, 3], [0, 0, 0])


@pytest.fixture
def setup(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    db = make_engine(url)
    changes, diagnoses = [], []
    tuner = Tuner(db, {"qa", "long"}, changes.append, request_diagnosis=diagnoses.append, window=timedelta(minutes=5))
    return db, tuner, changes, diagnoses


def _start(db, mode: str, cooldown: float = 0.0):
    PolicyRepository(db).ensure(PolicyDocument(global_=Policy(tuner_mode=mode, cooldown_s=cooldown)).body(), "test")


def test_auto_switches_off_a_bad_class_and_audits_it(setup):
    db, tuner, changes, diagnoses = setup
    _start(db, "auto")
    insert_records(db, _bad_records(50))
    decisions = {d["prompt_class"]: d for d in tuner.run_once()}
    assert decisions["qa"]["action"] == "off" and decisions["qa"]["applied"]
    assert decisions["long"]["action"] == "keep"  # no data: policy stands
    assert diagnoses == ["qa"]
    (written,) = changes
    assert written.body["classes"]["qa"] == {"speculation_enabled": False, "num_speculative_tokens": 3}
    audit = PolicyRepository(db).audit(5, 0)
    assert audit[0].actor == "tuner" and "qa" in audit[0].reason


def test_advise_records_but_applies_nothing(setup):
    db, tuner, changes, _diagnoses = setup
    _start(db, "advise")
    insert_records(db, _bad_records(50))
    decisions = {d["prompt_class"]: d for d in tuner.run_once()}
    assert decisions["qa"]["action"] == "off" and not decisions["qa"]["applied"]
    assert changes == [] and PolicyRepository(db).current().version == 1


def test_frozen_decides_nothing_and_cooldown_holds(setup):
    db, tuner, _changes, _ = setup
    _start(db, "frozen")
    insert_records(db, _bad_records(50))
    assert tuner.run_once() == []
    repo = PolicyRepository(db)
    current = repo.current()
    body = PolicyDocument(global_=Policy(tuner_mode="auto", cooldown_s=3600)).body()
    repo.write(body, current.version, "ola", "unfreeze", "replace")
    first = tuner.run_once()
    assert any(d["applied"] for d in first)
    assert [d for d in tuner.run_once() if d["prompt_class"] == "qa"] == []  # qa is cooling down


def _good_records(n: int, at: float, prefix: str):
    return _qa_records(n, [10, 10, 10], [9, 8, 7], at, prefix)


def _steps(db, minute, per_bucket: dict[int, dict[int, float]], steps: int = 200):
    from spectune.store.db import insert_ignoring_duplicates, utc
    from spectune.store.models import StepStat

    rows = [
        dict(
            instance_id="i",
            minute=utc(minute),
            batch_bucket=b,
            num_speculative_tokens=n,
            writer="w",
            steps=steps,
            step_time_sum_s=t * steps,
            step_time_p50_s=t,
            step_time_p95_s=t,
            batch_size_sum=b * steps,
            scheduled_tokens=b * (n + 1) * steps,
            num_draft_tokens=b * n * steps,
            num_accepted_tokens=0,
            accepted_per_position=[],
        )
        for b, per in per_bucket.items()
        for n, t in per.items()
    ]
    insert_ignoring_duplicates(db, StepStat.__table__, rows)


def test_per_batch_table_cost_probe_and_realised_speedup(tmp_path):
    from datetime import UTC, datetime

    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    db = make_engine(url)
    now = [datetime(2026, 1, 1, 12, tzinfo=UTC).timestamp()]
    clock = lambda: datetime.fromtimestamp(now[0], UTC)  # noqa: E731
    changes = []
    tuner = Tuner(db, {"qa"}, changes.append, interval=timedelta(minutes=1), clock=clock)
    PolicyRepository(db, clock=clock).ensure(
        PolicyDocument(global_=Policy(cooldown_s=0, n_min=0, n_max=6)).body(), "test"
    )
    # Batch 1 is cheap to verify (fitted from N=0 and N=3); batch 8 has been seen at N=3 only.
    _steps(db, now[0] - 120, {1: {0: 0.10, 3: 0.13}, 8: {3: 0.80}})
    insert_records(db, _good_records(20, now[0] - 30, "a"))
    (first,) = tuner.run_once()
    assert first["applied"] and first["inputs"]["cost_probes"] == [8]
    assert {"min_batch": 5, "max_batch": 8, "num_speculative_tokens": 0} in first["inputs"]["batch_table"]  # probe only
    # The probe measures batch 8 at N=0: N=3 costs 4x there, so batch 8 stays off; batch 1 goes up.
    now[0] += 60
    _steps(db, now[0] - 60, {1: {first["n_after"]: 0.10 + 0.01 * first["n_after"]}, 8: {0: 0.20}})
    insert_records(db, _good_records(20, now[0] - 10, "b"))
    (second,) = tuner.run_once()
    costs = second["inputs"]["costs"]
    assert costs["8"]["source"] == "fit" and costs["8"]["cost_ratio"] == pytest.approx(1.0, rel=0.01)
    table = {(e["min_batch"], e["max_batch"]): e["num_speculative_tokens"] for e in second["inputs"]["batch_table"]}
    assert table[(5, 4096)] == 0 and second["inputs"]["cost_probes"] == []
    assert changes[-1].body["classes"]["qa"]["batch_table"] == second["inputs"]["batch_table"]
    # A later run closes the first decision with a realised speedup from what was measured after it.
    now[0] += 60
    tuner.run_once()
    from sqlalchemy import select

    from spectune.store.models import TunerDecision

    with db.connect() as conn:
        realised = dict(conn.execute(select(TunerDecision.id, TunerDecision.realised_speedup)).all())
    assert realised[1] is not None and realised[1] > 1.0
