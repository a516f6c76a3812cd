"""The tuner's one read of what it last applied per class and action, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import insert

from spectune.store.db import make_engine, upgrade
from spectune.store.models import TunerDecision
from spectune.store.tuner_inputs import last_applied

T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)


def _decision(cls: str, action: str, minutes: int, n_after: int, applied: bool = True, n_before: int = 0) -> dict:
    return dict(at=T0 + timedelta(minutes=minutes), instance_id="*", prompt_class=cls, batch_bucket=1, mode="auto",
                action=action, n_before=n_before, n_after=n_after, inputs={}, applied=applied)  # fmt: skip


def test_last_applied_per_action_the_last_change_and_the_setting_in_force_and_until_when(db_url):
    upgrade(db_url)
    db = make_engine(db_url)
    with db.begin() as conn:
        conn.execute(insert(TunerDecision), [
            _decision("qa", "set_n", 0, 3),
            _decision("qa", "set_n", 5, 4, n_before=3),
            _decision("qa", "explore", 8, 5),
            _decision("qa", "cost_probe", 9, 0),
            _decision("qa", "explore", 10, 3),
            _decision("qa", "set_n", 12, 2, applied=False),  # advised, never applied
            _decision("chat", "cost_probe", 1, 0),
        ])  # fmt: skip
    applied = last_applied(db)
    now = T0 + timedelta(minutes=20)
    assert applied.age("qa", now) == timedelta(minutes=15)  # the last change: measurements excluded
    assert applied.age("qa", now, "explore") == timedelta(minutes=10)
    assert applied.age("qa", now, "cost_probe") == timedelta(minutes=11)
    explored = applied.exploration("qa")  # the last applied decision: its setting is in force
    assert (explored.action, explored.at, explored.n_after) == ("explore", T0 + timedelta(minutes=10), 3)
    assert explored.until is None and explored.in_force and explored.in_force_for(now) == timedelta(minutes=10)
    # The set_n of minute 5 ran until the explore of minute 8; a cost probe, a measurement, ends one too.
    earlier = applied.last("qa", "set_n")
    assert (earlier.n_before, earlier.n_after, earlier.until) == (3, 4, T0 + timedelta(minutes=8))
    assert applied.last("qa", "cost_probe").in_force_for(now) == timedelta(minutes=1)  # until the explore
    assert applied.last("chat", "explore") is None
    assert applied.age("chat", now) == timedelta.max  # only measured, never changed
    assert applied.exploration("chat") is None  # its last applied decision is a cost probe
    assert applied.age("long", now, "explore") == timedelta.max and applied.exploration("long") is None
