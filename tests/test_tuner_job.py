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


def _bad_records(n: int):
    out = []
    for r in make_records(n, prefix=f"bad{time.time_ns()}"):
        out.append(
            r.model_copy(
                update={
                    "prompt_class": "qa",
                    "drafted_per_position": [3, 3, 3],
                    "accepted_per_position": [0, 0, 0],
                    "num_draft_tokens": 9,
                    "num_accepted_tokens": 0,
                    "finish_time": time.time(),
                }
            )
        )
    return out


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
