"""The return half of the loop: API routes and the tuner write through one ``PolicyService``; what
is written reaches its subscribers (the engine) from the server's event loop, never another thread."""

from __future__ import annotations

import asyncio
import re
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from spectune.app import create_app
from spectune.control import PolicyService
from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.policies import PolicyRepository, Versioned
from spectune.tuner.job import Tuner
from spectune.tuner.policy import Policy, PolicyDocument
from spectune.tuner.task import TunerTask

from conftest import OPERATOR, VIEWER, token_specs
from records import make_records
from servers import wait_for


class Engine:
    """A subscriber standing for an engine of capacity ``capacity``: the versions it ran, and on
    which thread it was given them."""

    def __init__(self, capacity: int = 6) -> None:
        self.capacity = capacity
        self.applied: list[Versioned] = []
        self.threads: set[int] = set()

    def check(self, doc: PolicyDocument) -> None:
        if doc.global_.num_speculative_tokens > self.capacity:
            raise ValueError(f"num_speculative_tokens exceeds this engine's capacity {self.capacity}")

    async def apply(self, current: Versioned) -> None:
        self.threads.add(threading.get_ident())
        self.applied.append(current)


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def _bad_qa(n: int = 50):
    update = {"prompt_class": "qa", "drafted_per_position": [3, 3, 3], "accepted_per_position": [0, 0, 0],
              "num_draft_tokens": 9, "num_accepted_tokens": 0, "num_spec_steps": 3}  # fmt: skip
    return [r.model_copy(update=update) for r in make_records(n, prefix="bad")]


def test_an_api_write_returns_once_every_subscriber_runs_it_and_a_refused_one_is_not_written(db):
    service, engine = PolicyService(db, {"qa"}), Engine(capacity=4)
    service.subscribe(engine)
    with TestClient(create_app(None, db, token_specs(), policies=service)) as api:
        assert [v.version for v in engine.applied] == [1]  # the stored policy, in force from start
        etag = api.get("/api/v1/policy", headers=VIEWER).headers["ETag"]
        patch = {"global": {"num_speculative_tokens": 4}}
        r = api.patch("/api/v1/policy", json=patch, headers={**OPERATOR, "If-Match": etag})
        assert r.status_code == 200, r.text
        assert [v.version for v in engine.applied] == [1, 2] and engine.applied[-1].body == r.json()["policy"]

        too_long = {"global": {"num_speculative_tokens": 5}}
        r = api.patch("/api/v1/policy", json=too_long, headers={**OPERATOR, "If-Match": '"2"'})
        assert r.status_code == 422 and "capacity 4" in r.text
        assert service.current().version == 2 and len(engine.applied) == 2


def test_a_tuner_tick_writes_in_a_worker_thread_and_publishes_from_the_event_loop(db):
    service, engine = PolicyService(db, {"qa"}), Engine()
    service.subscribe(engine)
    PolicyRepository(db).ensure(PolicyDocument(global_=Policy(cooldown_s=0)).body(), "test")
    insert_records(db, _bad_qa())
    writers: set[int] = set()
    commit = service.commit

    def recording_commit(*args, **kwargs):
        writers.add(threading.get_ident())
        return commit(*args, **kwargs)

    service.commit = recording_commit

    async def tick() -> tuple[list[dict], int]:
        return await TunerTask(Tuner(service), 60).tick(), threading.get_ident()

    decisions, loop_thread = asyncio.run(tick())
    (qa,) = decisions
    assert qa["action"] == "off" and qa["applied"]
    (written,) = engine.applied
    assert written.version == 2 and written.by == "tuner"
    assert written.body["classes"]["qa"]["speculation_enabled"] is False
    assert engine.threads == {loop_thread} and writers and loop_thread not in writers


def test_a_tuner_write_a_subscriber_cannot_run_is_not_written_and_its_decisions_say_so(db):
    class Refusing(Engine):
        def check(self, doc: PolicyDocument) -> None:
            if doc.classes:
                raise ValueError("this engine runs the global policy only")

    service, engine = PolicyService(db, {"qa"}), Refusing()
    service.subscribe(engine)
    PolicyRepository(db).ensure(PolicyDocument(global_=Policy(cooldown_s=0)).body(), "test")
    insert_records(db, _bad_qa())
    (qa,) = asyncio.run(TunerTask(Tuner(service), 60).tick())
    assert qa["action"] == "off" and not qa["applied"]
    assert service.current().version == 1 and engine.applied == []


def test_the_tuner_task_runs_every_interval_until_stopped(db):
    service, engine = PolicyService(db, {"qa"}), Engine()
    service.subscribe(engine)
    PolicyRepository(db).ensure(PolicyDocument(global_=Policy(tuner_mode="advise")).body(), "test")
    insert_records(db, _bad_qa())
    runs: list[int] = []
    tuner = Tuner(service, window=timedelta(minutes=5), on_decisions=lambda d: runs.append(len(d)))

    async def main() -> None:
        task = TunerTask(tuner, 0.01)
        task.start()
        await asyncio.to_thread(wait_for, lambda: len(runs) >= 3, 120, "three tuner runs")
        await task.stop()

    asyncio.run(main())
    assert all(n == 1 for n in runs) and engine.applied == []  # advise: decided every run, applied nothing


def test_a_stored_policy_a_subscriber_cannot_run_is_left_out_at_start_and_the_others_run_it(db, caplog):
    PolicyRepository(db).ensure(PolicyDocument(global_=Policy(num_speculative_tokens=5)).body(), "operator")
    small, large = Engine(capacity=3), Engine(capacity=6)
    service = PolicyService(db, {"qa"})
    service.subscribe(small)
    service.subscribe(large)
    current = asyncio.run(service.resume(PolicyDocument(), "spectune"))
    assert current.version == 1 and small.applied == [] and [v.version for v in large.applied] == [1]
    assert "stored policy v1 not applied" in caplog.text


def test_routes_take_what_they_need_as_typed_dependencies_not_from_the_application_state():
    api = Path(__file__).resolve().parents[1] / "spectune" / "api"
    readers = sorted(p.name for p in api.glob("*.py") if re.search(r"\bapp\.state\b", p.read_text()))
    assert readers == ["deps.py"]
