"""One tuner decides at a time: the lease is re-checked every run and its epoch fences every write."""

from __future__ import annotations

import time
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import func, select

from spectune.control import PolicyService
from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.leader import LOCK_KEY, LeaderLease, StaleLeaderError
from spectune.store.models import TunerDecision
from spectune.store.policies import PolicyRepository
from spectune.tuner.job import Tuner
from spectune.tuner.policy import Policy, PolicyDocument

from records import make_records


def _bad_records(n: int):
    update = dict(prompt_class="qa", drafted_per_position=[3, 3, 3], accepted_per_position=[0, 0, 0],
                  num_draft_tokens=9, num_accepted_tokens=0, num_spec_steps=3, finish_time=time.time())  # fmt: skip
    return [r.model_copy(update=update) for r in make_records(n, prefix=f"lead{time.time_ns()}")]


def _epochs(db) -> dict[int, int]:
    with db.connect() as conn:
        rows = conn.execute(select(TunerDecision.leader_epoch, func.count()).group_by(TunerDecision.leader_epoch))
        return dict(rows.all())


def _tuner(db, holder: str) -> Tuner:
    return Tuner(PolicyService(db, {"qa"}), window=timedelta(minutes=5), holder=holder)


def test_sqlite_holds_the_lease_from_the_first_run(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    db = make_engine(url)
    PolicyRepository(db).ensure(PolicyDocument(global_=Policy(tuner_mode="advise")).body(), "test")
    insert_records(db, _bad_records(50))
    tuner = _tuner(db, "only")
    assert tuner.run_once() and tuner.run_once()
    assert _epochs(db) == {1: 2}


def test_a_replica_takes_over_when_the_leaders_session_dies_and_the_old_leader_writes_nothing(pg_server):
    pg_server.reset()
    upgrade(pg_server.url)
    db_a, db_b = make_engine(pg_server.url, timeout_s=5), make_engine(pg_server.url, timeout_s=5)
    PolicyRepository(db_a).ensure(PolicyDocument(global_=Policy(tuner_mode="advise")).body(), "test")
    insert_records(db_a, _bad_records(50))
    a, b = _tuner(db_a, "replica-a"), _tuner(db_b, "replica-b")
    assert a.run_once() and b.run_once() == [] and a.run_once()  # a leads and keeps leading
    # Kill a's lock session, as a failover or an idle-session killer would.
    with psycopg.connect(pg_server.url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as admin:
        (pid,) = admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND granted", (LOCK_KEY,)
        ).fetchone()
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # the backend exits (and its lock goes) asynchronously: wait for that, not for a fixed time
        deadline = time.time() + 10
        held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND granted"
        while admin.execute(held, (LOCK_KEY,)).fetchone()[0]:
            assert time.time() < deadline, "the terminated backend kept its lock"
            time.sleep(0.01)
    taken = b.run_once()
    assert taken and {d["leader_epoch"] for d in taken} == {2}
    assert a.run_once() == [] and a.leader.epoch is None  # its check finds the lock gone; b holds it now
    # A leader that never noticed (its check passed just before it lost the lease) is fenced by the database.
    a.leader.epoch, a.leader.acquire = 1, lambda: 1
    assert a.run_once() == []
    assert _epochs(db_a) == {1: 2, 2: 1}
    assert b.run_once() and _epochs(db_a) == {1: 2, 2: 2}


def test_a_lease_never_acquired_writes_nothing(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    db = make_engine(url)
    with pytest.raises(StaleLeaderError, match="refused"), db.begin() as conn:
        LeaderLease(db, "never").fence(conn)
