"""The tuner job against a real database: modes, cooldown, audit, diagnosis."""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert

from spectune.control import PolicyService
from spectune.engine.schema import BatchRange
from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.models import TunerDecision
from spectune.store.policies import PolicyRepository
from spectune.tuner.goodput import position_acceptance
from spectune.tuner.job import Tuner
from spectune.tuner.policy import Policy, PolicyDocument
from spectune.tuner.task import TunerTask

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


class _Applied:
    """A subscriber of the policy service standing for the engine: the versions it was given."""

    def __init__(self, changes: list) -> None:
        self.changes = changes

    def check(self, doc: PolicyDocument) -> None:
        pass

    async def apply(self, current) -> None:
        self.changes.append(current)


def _service(db, classes: set[str], changes: list | None = None, **clock) -> PolicyService:
    service = PolicyService(db, classes, **clock)
    if changes is not None:
        service.subscribe(_Applied(changes))
    return service


def _tick(tuner: Tuner) -> list[dict]:
    """One run as the server makes it (``TunerTask``): decide and write in a worker thread, then publish."""
    return asyncio.run(TunerTask(tuner, tuner.interval.total_seconds()).tick())


@pytest.fixture
def setup(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    db = make_engine(url)
    changes, diagnoses = [], []
    service = _service(db, {"qa", "long"}, changes)
    tuner = Tuner(service, request_diagnosis=diagnoses.append, window=timedelta(minutes=5))
    return db, tuner, changes, diagnoses


def _start(db, mode: str, cooldown: float = 0.0):
    PolicyRepository(db).ensure(PolicyDocument(global_=Policy(tuner_mode=mode, cooldown_s=cooldown)).body(), "test")


def test_auto_switches_off_a_bad_class_and_audits_it(setup):
    db, tuner, changes, diagnoses = setup
    _start(db, "auto")
    insert_records(db, _bad_records(50))
    decisions = {d["prompt_class"]: d for d in _tick(tuner)}
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
    decisions = {d["prompt_class"]: d for d in _tick(tuner)}
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


def _timed_records(k: int, at: float, ttft: float, n: int | None = None, batch: float | None = None,
                   tpot: float | None = None):  # fmt: skip
    """k ``_good_records`` finished at ``at`` that took ``ttft`` to their first token, admitted at N = ``n``
    at mean batch size ``batch`` with ``tpot`` (where given); at N = 0 they drafted nothing: plain."""
    given = (("num_speculative_tokens", n), ("batch_size_mean", batch), ("tpot_s", tpot))
    update = {"ttft_s": ttft, **{name: v for name, v in given if v is not None}}
    if n == 0:
        update |= {"drafted_per_position": [], "accepted_per_position": [], "num_draft_tokens": 0,
                   "num_accepted_tokens": 0, "num_spec_steps": 0}  # fmt: skip
    return [r.model_copy(update=update) for r in _good_records(k, at, f"t{ttft}-{n}-{batch}-{at}")]


def _accepted_per_step(n: int) -> float:
    """Tokens a decode step at N accepts per request with ``_good_records``' acceptance (0.9, 8/9, 7/8,
    then 7/8 again): the steps then yield what the records' acceptance predicts."""
    alphas = [0.9, 8 / 9, 7 / 8]
    total, reach = 0.0, 1.0
    for j in range(n):
        reach *= alphas[min(j, len(alphas) - 1)]
        total += reach
    return total


def _steps(db, minute, per_bucket: dict[int, dict[int, float]], steps: int = 200, prefill=None):
    """Step rows; ``prefill`` {(bucket, N): (steps that also prefilled, u)} gives them the prefill time
    that makes what prompts cost on top u seconds per generated token.  Decode steps accept what
    ``_good_records`` predicts."""
    from spectune.store.db import insert_ignoring_duplicates, utc
    from spectune.store.models import StepStat

    def prefill_columns(b: int, n: int, t: float) -> dict:
        p_steps, u = (prefill or {}).get((b, n), (0, 0.0))
        generated = b * steps + round(b * steps * _accepted_per_step(n)) + b * p_steps
        return dict(prefill_steps=p_steps, prefill_time_sum_s=u * generated + p_steps * t,
                    prefill_generated_tokens=b * p_steps)  # fmt: skip

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
            num_accepted_tokens=round(b * steps * _accepted_per_step(n)),
            accepted_per_position=[],
            **prefill_columns(b, n, t),
        )
        for b, per in per_bucket.items()
        for n, t in per.items()
    ]
    insert_ignoring_duplicates(db, StepStat.__table__, rows)


def _clocked_tuner(tmp_path, interval: timedelta, changes: list | None = None, **policy):
    """A tuner on a fresh SQLite store and a hand-moved clock (``now[0]``), cooldown 0 unless ``policy`` says."""
    from datetime import UTC, datetime

    url = f"sqlite:///{tmp_path}/t.db"
    upgrade(url)
    db = make_engine(url)
    now = [datetime(2026, 1, 1, 12, tzinfo=UTC).timestamp()]
    clock = lambda: datetime.fromtimestamp(now[0], UTC)  # noqa: E731
    tuner = Tuner(_service(db, {"qa"}, changes, clock=clock), interval=interval)
    PolicyRepository(db, clock=clock).ensure(
        PolicyDocument(global_=Policy(**{"cooldown_s": 0, **policy})).body(), "test"
    )
    return db, tuner, now


def test_per_batch_table_cost_probe_and_realised_speedup(tmp_path):
    changes = []
    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), changes, n_min=0, n_max=6)
    # Batch 1 is cheap to verify (fitted from N=0 and N=3) and carries the load; batch 8 has been
    # seen at N=3 only.
    _steps(db, now[0] - 120, {1: {0: 0.10, 3: 0.13}}, steps=2000)
    _steps(db, now[0] - 120, {8: {3: 0.80}})
    insert_records(db, _good_records(20, now[0] - 30, "a"))
    (first,) = _tick(tuner)
    assert first["applied"] and first["inputs"]["cost_probes"] == [8]
    assert {"min_batch": 5, "max_batch": 8, "num_speculative_tokens": 0} in first["inputs"]["batch_table"]  # probe only
    # The probe measures batch 8 at N=0: N=3 costs 4x there, so batch 8 stays off; batch 1 goes up.
    now[0] += 60
    _steps(db, now[0] - 60, {1: {first["n_after"]: 0.10 + 0.01 * first["n_after"]}}, steps=2000)
    _steps(db, now[0] - 60, {8: {0: 0.20}})
    insert_records(db, _good_records(20, now[0] - 10, "b"))
    (second,) = _tick(tuner)
    costs = second["inputs"]["costs"]
    assert costs["8"]["source"] == "fit" and costs["8"]["cost_ratio"] == pytest.approx(1.0, rel=0.01)
    table = {(e["min_batch"], e["max_batch"]): e["num_speculative_tokens"] for e in second["inputs"]["batch_table"]}
    assert table[(5, 4096)] == 0 and second["inputs"]["cost_probes"] == []
    assert changes[-1].body["classes"]["qa"]["batch_table"] == second["inputs"]["batch_table"]
    # A later run closes the first decision with a realised speedup from what was measured after it.
    now[0] += 60
    _tick(tuner)
    from sqlalchemy import select

    from spectune.store.models import TunerDecision

    with db.connect() as conn:
        realised = dict(conn.execute(select(TunerDecision.id, TunerDecision.realised_speedup)).all())
    assert realised[1] is not None and realised[1] > 1.0


@pytest.mark.parametrize("prompts_measured", [False, True])
def test_what_prompts_cost_with_the_drafter_can_make_plain_pay(tmp_path, prompts_measured):
    from spectune.engine.schema import n_for_batch
    from spectune.store.tuner_inputs import prefill_costs

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), n_min=0, n_max=4)
    # Batch 8, fitted: decode steps alone say N=2 gains ~1.6x; but prompts cost 0.03 s per generated
    # token plain and 0.06 s with the drafter prefilling too (this CPU at batch 8 is like that).
    prefill = {(8, 0): (20, 0.03), (8, 1): (10, 0.06), (8, 2): (10, 0.06)} if prompts_measured else None
    _steps(db, now[0] - 120, {8: {0: 0.20, 1: 0.26, 2: 0.32}}, prefill=prefill)
    insert_records(db, _good_records(20, now[0] - 30, "a"))
    measured = prefill_costs(db, datetime.fromtimestamp(now[0] - 3600, UTC))
    if prompts_measured:
        assert measured[8]["batch"] == 8 and measured[8]["off"] == pytest.approx(0.03)
        assert measured[8]["on"] == pytest.approx(0.06)  # N > 0 pooled
    else:
        assert measured[8]["off"] is None and measured[8]["on"] is None
    (decision,) = tuner.run_once()
    cost = decision["inputs"]["costs"]["8"]
    n_at_8 = n_for_batch([BatchRange(**e) for e in decision["inputs"]["batch_table"]], 8, decision["n_after"])
    if prompts_measured:
        assert cost["prefill_s_per_token"]["off"] == pytest.approx(0.03)
        # off: the model's speedup of the N it had is below 1 once prompts are counted
        assert decision["action"] == "off" and n_at_8 == 0 and decision["predicted_speedup"] < 1.0, decision
    else:
        assert cost["prefill_s_per_token"] == {"batch": 8.0, "off": None, "on": None}
        assert n_at_8 > 0 and decision["predicted_speedup"] > 1.4, decision


def test_a_bucket_without_plain_steps_is_probed_before_any_speedup_is_claimed(tmp_path):
    from sqlalchemy import select

    from spectune.store.models import TunerDecision

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1))
    # Batch 1 measured at N=1..3 (a fit), never at N=0: its t0 would be the fit's intercept.
    _steps(db, now[0] - 120, {1: {1: 0.13, 2: 0.16, 3: 0.19}})
    insert_records(db, _good_records(20, now[0] - 30, "a"))
    (first,) = tuner.run_once()
    assert first["action"] == "cost_probe" and first["inputs"]["cost_probes"] == [1] and first["n_after"] == 0
    assert first["inputs"]["baseline"]["kind"] == "extrapolated"
    # Speculative steps and records follow every decision, still no plain steps: no decision is closed
    # against the model's t0.
    for prefix in "bc":
        now[0] += 60
        (decision,) = tuner.run_once()
        _steps(db, now[0] + 10, {1: {max(1, decision["n_after"]): 0.19}})
        insert_records(db, _good_records(20, now[0] + 20, prefix))
    now[0] += 60
    tuner.run_once()
    with db.connect() as conn:
        assert conn.execute(select(TunerDecision.realised_speedup)).scalars().all() == [None] * 4
    # Plain steps measured: the decisions after them state a measured baseline.
    _steps(db, now[0] - 30, {1: {0: 0.09}})
    insert_records(db, _good_records(20, now[0] - 10, "d"))
    now[0] += 1
    (later,) = tuner.run_once()
    assert later["inputs"]["baseline"]["kind"] == "measured_plain_steps" and later["inputs"]["cost_probes"] == []


def test_a_bucket_whose_plain_step_is_measured_is_not_probed_to_plain_again(tmp_path):
    from spectune.engine.schema import n_for_batch

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), n_min=0, n_max=4)
    # Batch 8 ran plain only (its cost is borrowed from batch 1): running at N there measures what a
    # probe to N=0 cannot, and a probe would demote every request in flight.
    _steps(db, now[0] - 120, {1: {0: 0.10, 3: 0.13}, 8: {0: 0.20}})
    insert_records(db, _good_records(20, now[0] - 30, "a"))
    (first,) = tuner.run_once()
    assert first["inputs"]["costs"]["8"]["source"].startswith("bucket 1")
    assert first["action"] != "cost_probe" and first["inputs"]["cost_probes"] == []
    table = [BatchRange(**e) for e in first["inputs"]["batch_table"]]
    assert n_for_batch(table, 8, first["n_after"]) > 0, first


def test_a_probe_is_not_repeated_before_its_steps_can_have_landed(tmp_path):
    from spectune.tuner.job import PROBE_SETTLE

    # n_max 3: every N is measured, so nothing is explored (an exploration would be held, probes with it).
    db, tuner, now = _clocked_tuner(tmp_path, timedelta(seconds=10), n_max=3)
    _steps(db, now[0] - 120, {1: {1: 0.13, 2: 0.16, 3: 0.19}})
    insert_records(db, _good_records(20, now[0] - 30, "a"))
    actions, times = [], []
    for _ in range(8):  # 80 s of 10 s intervals; no step of the probe ever lands (no traffic at N=0)
        (decision,) = tuner.run_once()
        actions.append(decision["action"])
        times.append(now[0])
        now[0] += 10
    probes = [t for t, a in zip(times, actions, strict=True) if a == "cost_probe"]
    assert probes[0] == times[0] and len(probes) >= 2  # probed, and again once the first could have landed
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert min(gaps) >= (PROBE_SETTLE + tuner.interval).total_seconds()


def test_a_run_reads_the_store_a_bounded_number_of_times_however_many_decisions_are_open(tmp_path):
    """Decisions that cannot be closed (no plain step measured near them) stay open for four windows
    and are looked at every run; each used to cost seven reads a run (a fleet test's leader, 2 s
    interval, spent its interval on them)."""
    from sqlalchemy import event, func, select

    from spectune.store.models import TunerDecision

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(seconds=2))
    _steps(db, now[0] - 120, {1: {1: 0.13, 2: 0.16, 3: 0.19}})  # never a plain step: nothing closes
    statements = []
    event.listen(db, "before_cursor_execute", lambda *args: statements.append(1))
    per_run = []
    for i in range(60):
        insert_records(db, _good_records(5, now[0] - 1, f"r{i}-"))
        statements.clear()
        tuner.run_once()
        per_run.append(len(statements))
        now[0] += 2
    with db.connect() as conn:
        still_open = conn.execute(
            select(func.count()).where(TunerDecision.realised_speedup.is_(None), TunerDecision.n_after > 0)
        ).scalar()
    assert still_open >= 30, still_open
    assert max(per_run[-10:]) <= max(per_run[:10]), per_run  # not growing with the open decisions


def test_a_bucket_where_most_requests_no_longer_draft_runs_plain(tmp_path):
    """Bucket 8's steps at N=1 ran with one request in eight drafting (the rest demoted: the drafter
    runs over the batch, few verify). Counting every request as drafting, the model says N=1 pays
    there (1.9 tokens a step for 1.2x the time); with the measured share it does not, and bucket 8
    runs plain while batch 1 speculates."""
    from spectune.engine.schema import n_for_batch
    from spectune.store.db import insert_ignoring_duplicates, utc
    from spectune.store.models import StepStat

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), n_min=0, n_max=3)
    _steps(db, now[0] - 120, {1: {0: 0.10, 1: 0.11, 2: 0.12}}, steps=2000)  # batch 1 carries the load
    _steps(db, now[0] - 120, {8: {0: 0.20}})
    rows = [dict(instance_id="i", minute=utc(now[0] - 60), batch_bucket=8, num_speculative_tokens=1, writer="w",
                 steps=200, step_time_sum_s=0.24 * 200, step_time_p50_s=0.24, step_time_p95_s=0.24,
                 batch_size_sum=8 * 200, scheduled_tokens=9 * 200, num_draft_tokens=200,
                 num_accepted_tokens=180, accepted_per_position=[])]  # fmt: skip
    insert_ignoring_duplicates(db, StepStat.__table__, rows)
    insert_records(db, _good_records(20, now[0] - 30, "a"))
    (decision,) = tuner.run_once()
    cost = decision["inputs"]["costs"]["8"]
    assert cost["drafting_share"] == {"1": pytest.approx(1 / 8)}, cost
    table = [BatchRange(**e) for e in decision["inputs"]["batch_table"]]
    assert n_for_batch(table, 8, decision["n_after"]) == 0, decision["inputs"]
    assert n_for_batch(table, 1, decision["n_after"]) > 0


def test_another_drafts_acceptance_does_not_decide_after_a_draft_change(setup):
    """A class off under a bad draft: after the policy swaps the draft, the hour of history the tuner
    falls back on (too few drafts in the window) holds only the new draft's probes."""
    db, tuner, _changes, _ = setup
    repo = PolicyRepository(db)
    doc = PolicyDocument(global_=Policy(tuner_mode="auto", cooldown_s=0.0, draft_model="/drafts/bad")).body()
    doc["classes"] = {"qa": {"speculation_enabled": False}}
    repo.ensure(doc, "test")
    insert_records(db, _qa_records(200, [3, 3, 3], [0, 0, 0], at=time.time() - 600))  # the bad draft, 10 min ago
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["inputs"]["acceptance"] == 0.0  # the last hour's history stands in for the window
    swapped = {**doc, "global": {**doc["global"], "draft_model": "/drafts/good"}}
    repo.write(swapped, repo.current().version, "operator", "new draft", "replace")
    insert_records(db, _qa_records(5, [3, 3, 3], [3, 3, 3]))  # 15 first-position trials: too few
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "keep" and qa["inputs"]["acceptance"] is None, qa["inputs"]["reason"]
    assert qa["inputs"]["drafted_per_position"] == [15, 15, 15]  # not the old draft's 600
    insert_records(db, _qa_records(10, [3, 3, 3], [3, 3, 3]))
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "on" and qa["applied"] and qa["inputs"]["acceptance"] == 1.0


def test_an_off_class_whose_table_keeps_its_busiest_bucket_plain_is_probed_there_after_a_draft_change(tmp_path):
    """The lock-out seen in the tuner engine test: under a bad draft the table got N = 0 at the busiest
    bucket, then the class went off.  Probes obey the table, so after the swap to a good draft they
    drafted nothing ("too little data" for ever).  With nothing of the draft in force measured, the
    tuner opens that bucket to probes (no cooldown: a measurement), and their drafts bring it back."""
    from spectune.engine.schema import RuntimeSettings
    from spectune.tuner.policy import runtime_settings

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), draft_model="/drafts/good")
    repo = PolicyRepository(db, clock=tuner.clock)
    doc = repo.current().body
    doc["global"]["cooldown_s"] = 300.0  # a reprobe must not start one
    doc["classes"] = {
        "qa": {
            "speculation_enabled": False,
            "batch_table": [BatchRange(min_batch=3, max_batch=4096, num_speculative_tokens=0).model_dump()],
        }
    }
    repo.write(doc, repo.current().version, "tuner", "off under the bad draft", "replace")
    _steps(db, now[0] - 60, {4: {0: 0.10}})  # the traffic runs at batch 3-4, plain

    def settings() -> RuntimeSettings:
        current = repo.current()
        return runtime_settings(PolicyDocument.model_validate(current.body), "i", {"qa"}, current.version)

    assert settings().n_for("qa", 4, capacity=6, probing=True) == 0  # locked out: probes draft nothing
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "reprobe" and qa["applied"], qa["inputs"]["reason"]
    assert settings().n_for("qa", 4, capacity=6, probing=True) == 3  # probes draft at the busiest bucket
    assert settings().n_for("qa", 4, capacity=6) == 0  # the class itself stays off
    assert settings().n_for("qa", 16, capacity=6, probing=True) == 0  # other zeros stand
    now[0] += 60
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "keep"  # opened once, not again
    insert_records(db, _qa_records(20, [3, 3, 3], [3, 3, 3], at=now[0] - 1))  # the probes' drafts
    _steps(db, now[0] - 30, {4: {3: 0.12}})
    now[0] += 60
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "on" and qa["applied"], qa["inputs"]["reason"]  # no cooldown after the reprobe


def test_an_on_class_whose_table_keeps_its_busiest_bucket_plain_is_opened_there_after_a_draft_change(tmp_path):
    """The lock-out seen in the tuner engine test, the other way round: under the good draft the table
    got N = 0 at the busiest bucket while the class stayed on.  After the swap to a bad draft the
    class drafted nothing there, so it kept "too little data: policy stands" and never went off.
    With nothing of the draft in force measured, the tuner opens that bucket (a measurement, no
    cooldown), and the bad draft's measured acceptance switches the class off."""
    from spectune.engine.schema import RuntimeSettings
    from spectune.tuner.policy import runtime_settings

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), draft_model="/drafts/bad")
    repo = PolicyRepository(db, clock=tuner.clock)
    doc = repo.current().body
    doc["global"]["cooldown_s"] = 300.0  # the opening must not start one
    doc["classes"] = {
        "qa": {"batch_table": [BatchRange(min_batch=3, max_batch=4096, num_speculative_tokens=0).model_dump()]}
    }
    repo.write(doc, repo.current().version, "tuner", "plain at 3+ under the good draft", "replace")
    _steps(db, now[0] - 60, {4: {0: 0.10}})

    def settings() -> RuntimeSettings:
        current = repo.current()
        return runtime_settings(PolicyDocument.model_validate(current.body), "i", {"qa"}, current.version)

    assert settings().n_for("qa", 4, capacity=6) == 0  # locked out: the bad draft is never measured
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "reprobe" and qa["applied"], qa["inputs"]["reason"]
    assert settings().n_for("qa", 4, capacity=6) == 3  # the busiest bucket drafts again
    now[0] += 60
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "keep"  # opened once, not again
    insert_records(db, _qa_records(20, [3, 3, 3], [0, 0, 0], at=now[0] - 1))  # the bad draft's drafts
    _steps(db, now[0] - 30, {4: {3: 0.14}})
    now[0] += 60
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    assert qa["action"] == "off" and qa["applied"], qa["inputs"]["reason"]  # no cooldown after the opening


def test_the_cost_comes_from_minutes_that_ran_both_sides_where_the_machine_drifted(tmp_path):
    from spectune.tuner.paired_cost import ESTIMATOR

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), n_min=1, n_max=4)
    # Three minutes ran plain and N=3 steps side by side (N=3 costs 1.2x); then the machine got 3x
    # slower (a neighbour) while only N=3 ran.  The means of each side say N=3 costs 3.4x: off.
    for k in (6, 5, 4):
        _steps(db, now[0] - 60 * k, {1: {0: 0.10, 3: 0.12}})
    for k in (3, 2, 1):
        _steps(db, now[0] - 60 * k, {1: {3: 0.36}}, steps=2000)
    insert_records(db, _good_records(40, now[0] - 30, "a"))
    (row,) = tuner.run_once()
    paired = row["inputs"]["costs"]["1"]["paired_ratio"]["3"]
    assert paired["ratio"] == pytest.approx(1.2) and paired["minutes"] == 3
    assert paired["low"] == pytest.approx(1.2) and paired["high"] == pytest.approx(1.2)  # the minutes agree
    assert row["action"] != "off" and row["n_after"] == 3, row["inputs"]["reason"]  # (larger batches: plain)
    low, high = row["inputs"]["predicted_interval"]
    assert low == pytest.approx(row["predicted_speedup"]) == pytest.approx(high) and row["predicted_speedup"] > 2
    assert row["inputs"]["speedup_estimator"] == ESTIMATOR


def test_the_guard_puts_a_bucket_measured_slower_than_plain_to_plain_even_in_a_cooldown(tmp_path):
    """Minutes that ran plain steps (control requests) beside steps at N=3: N=3 made 0.85x plain's
    tokens/s.  The class was changed a minute ago (cooldown 300 s): the guard acts anyway, and the
    decision row shows the measured speedup and its estimator."""
    from spectune.store.models import TunerDecision
    from spectune.tuner.paired_cost import SPEEDUP_ESTIMATOR

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), cooldown_s=300.0)
    changed = dict(instance_id="*", prompt_class="qa", batch_bucket=1, mode="auto", n_before=0, n_after=3,
                   predicted_speedup=1.3, inputs={}, applied=True)  # fmt: skip
    with db.begin() as conn:
        conn.execute(insert(TunerDecision), [dict(changed, at=datetime.fromtimestamp(now[0] - 60, UTC), action="on")])
    insert_records(db, _good_records(40, now[0] - 30, "a"))
    for k in (4, 3, 2):  # 3.4 tokens a step at N=3 in 0.40 s, 1 token in 0.10 s plain; 3x drift between minutes
        _steps(db, now[0] - 60 * k, {1: {0: 0.10 * k, 3: 0.40 * k}})
    (row,) = tuner.run_once()
    assert row["action"] == "guard" and row["applied"] and row["n_before"] == 3 and row["n_after"] == 0, row
    measured = row["inputs"]["measured_speedup"]["1"]["3"]
    assert measured["ratio"] == pytest.approx(0.85) and measured["minutes"] == 3
    assert row["inputs"]["measured_estimator"] == SPEEDUP_ESTIMATOR
    assert {"min_batch": 1, "max_batch": 1, "num_speculative_tokens": 0} in row["inputs"]["batch_table"]
    now[0] += 60
    assert tuner.run_once() == []  # now in the guard's own cooldown, and nothing left to guard at bucket 1


def test_a_draft_measured_faster_than_plain_waits_out_its_cooldown(tmp_path):
    from spectune.store.models import TunerDecision

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), cooldown_s=300.0)
    changed = dict(instance_id="*", prompt_class="qa", batch_bucket=1, mode="auto", n_before=0, n_after=3,
                   predicted_speedup=1.3, inputs={}, applied=True, action="on")  # fmt: skip
    with db.begin() as conn:
        conn.execute(insert(TunerDecision), [dict(changed, at=datetime.fromtimestamp(now[0] - 60, UTC))])
    insert_records(db, _good_records(40, now[0] - 30, "a"))
    for k in (4, 3, 2):
        _steps(db, now[0] - 60 * k, {1: {0: 0.10 * k, 3: 0.13 * k}})
    assert tuner.run_once() == []


@pytest.mark.parametrize("bucket", [1, 4])
def test_an_off_class_is_reprobed_where_its_probes_run_alone(tmp_path, bucket):
    """Seen in the replay on a drifting machine: a cost probe put batch 1 at N=0 for one interval, the
    next run switched the class off (a cost timed in a slow minute), and that entry kept every probe
    plain -- the class stayed off on its last acceptance for good.  At batch 1 a probe runs alone and
    costs only itself: the tuner opens the bucket.  At batch 3-4 one probe would make the drafter run
    over the whole batch: the table stands."""
    from spectune.engine.schema import RuntimeSettings
    from spectune.tuner.policy import runtime_settings

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1))
    repo = PolicyRepository(db, clock=tuner.clock)
    doc = repo.current().body
    doc["global"]["cooldown_s"] = 300.0  # a reprobe must not start one
    lo = 1 if bucket == 1 else 3
    plain_here = BatchRange(min_batch=lo, max_batch=bucket, num_speculative_tokens=0)
    doc["classes"] = {"qa": {"speculation_enabled": False, "batch_table": [plain_here.model_dump()]}}
    repo.write(doc, repo.current().version, "tuner", "off after a cost probe", "replace")
    insert_records(db, _qa_records(50, [3, 3, 3], [0, 0, 0], at=now[0] - 30))  # measured: it stays off
    _steps(db, now[0] - 60, {bucket: {0: 0.10}})

    def settings() -> RuntimeSettings:
        current = repo.current()
        return runtime_settings(PolicyDocument.model_validate(current.body), "i", {"qa"}, current.version)

    assert settings().n_for("qa", bucket, capacity=6, probing=True) == 0  # locked out
    qa = next(d for d in tuner.run_once() if d["prompt_class"] == "qa")
    if bucket == 1:
        assert qa["action"] == "reprobe" and qa["applied"], qa["inputs"]["reason"]
        assert settings().n_for("qa", 1, capacity=6, probing=True) == 3 and settings().n_for("qa", 1, capacity=6) == 0
    else:
        assert qa["action"] == "keep" and not qa["applied"], qa["inputs"]["reason"]
        assert settings().n_for("qa", bucket, capacity=6, probing=True) == 0


@pytest.mark.parametrize("budget", [0.0, 0.02])
def test_the_tuner_pays_control_requests_from_the_class_budget(tmp_path, budget):
    """An off class whose probes measure a draft that pays comes back on; with a control budget the
    change also sets the share of its requests served plain from the speedup it predicts."""
    from spectune.tuner.paired_cost import control_share

    changes = []
    db, tuner, now = _clocked_tuner(
        tmp_path, timedelta(minutes=1), changes, speculation_enabled=False, n_min=1, n_max=3, control_budget=budget
    )
    for k in (4, 3, 2):
        _steps(db, now[0] - 60 * k, {1: {0: 0.10, 3: 0.12}})
    insert_records(db, _good_records(40, now[0] - 30, "a"))
    (row,) = _tick(tuner)
    assert row["action"] == "on" and row["applied"], row["inputs"]["reason"]
    (written,) = changes
    qa = written.body["classes"]["qa"]
    if budget:
        assert qa["control_fraction"] == pytest.approx(control_share(budget, row["predicted_speedup"]), abs=1e-4)
    else:
        assert "control_fraction" not in qa  # the operator's share (default 0) stands


@pytest.mark.parametrize("beside_plain", [True, False])
def test_a_decision_is_realised_from_the_minutes_its_setting_ran_beside_plain(tmp_path, beside_plain):
    """After the decision the machine drifts by minutes (speed x0.5 to x3); where plain steps ran in the
    same minutes as steps at N (control requests), the realised speedup is their paired ratio, with its
    interval; the plain steps of the cost window, measured at another speed, would say half of it.
    Without plain steps beside it, the decision waits for them, then closes unpaired and says so."""
    from statistics import geometric_mean

    from sqlalchemy import select

    from spectune.store.models import TunerDecision

    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), n_min=0, n_max=4)
    start = now[0]
    _steps(db, start - 120, {1: {0: 0.05, 3: 0.065}}, steps=2000)  # the cost window: a fast minute
    insert_records(db, _good_records(20, start - 30, "a"))
    (first,) = tuner.run_once()
    n = first["n_after"]
    assert n > 0 and first["applied"], first
    ratios = []
    for m, drift in enumerate((1.0, 3.0, 0.5, 2.0, 1.0, 1.5)):
        wobble = 1 + 0.02 * (-1) ** m  # the minutes' ratios disagree a little: the interval has width
        per_n = {n: (0.10 + 0.01 * n) * drift * wobble, **({0: 0.10 * drift} if beside_plain else {})}
        _steps(db, start + 60 * m, {1: per_n}, steps=100)
        ratios.append((1 + _accepted_per_step(n)) / ((0.10 + 0.01 * n) * wobble / 0.10))

    # Its requests: at N at batch 1, plain beside them (control requests), plain at batch 5 (the table's
    # plain bucket) and before the decision (another setting): only the first two count, by arm.
    at_n = _timed_records(30, start + 100, 0.30, n=n, batch=1.0, tpot=0.05)
    plain = _timed_records(10, start + 200, 0.20, n=0, batch=1.0, tpot=0.10)
    elsewhere = _timed_records(10, start + 200, 5.0, n=0, batch=4.5, tpot=0.40) + _timed_records(
        10, start - 10, 9.0, n=n, batch=1.0, tpot=0.05
    )
    insert_records(db, at_n + plain + elsewhere)

    def realised():
        with db.connect() as conn:
            row = conn.execute(select(TunerDecision.__table__)).one()  # the one decision
        return row.realised_speedup, row.realised_estimator, row.realised_low, row.realised_high, row.realised_minutes

    now[0] = start + 3 * 60
    assert tuner.close_decisions(tuner.clock()) == 0  # younger than a window: not yet
    now[0] = start + 7 * 60
    if beside_plain:
        assert tuner.close_decisions(tuner.clock()) == 1
        speedup, estimator, low, high, minutes = realised()
        assert estimator == "paired" and minutes == 6
        assert speedup == pytest.approx(geometric_mean(ratios), rel=1e-3)  # equal weights; whole tokens per row
        assert low < speedup < high < 1.05 * low  # a 90 % interval from the minutes' +-2 % disagreement
        with db.connect() as conn:
            latency = conn.execute(select(TunerDecision.realised_latency)).scalar_one()
        assert (latency["bucket"], latency["n"]) == (1, n)
        assert latency["setting"]["requests"] == 30 and latency["plain"]["requests"] == 10
        assert latency["setting"]["ttft_s"] == {"p50": 0.30, "p95": 0.30}
        vs_plain = {"ttft_p50": 1.5, "ttft_p95": 1.5, "tpot_p50": 0.5, "tpot_p95": 0.5}
        assert latency["vs_plain"] == pytest.approx(vs_plain)
        return
    assert tuner.close_decisions(tuner.clock()) == 0  # a control request may yet come
    now[0] = start + 11 * 60
    assert tuner.close_decisions(tuner.clock()) == 1
    speedup, estimator, low, high, minutes = realised()
    assert estimator == "unpaired" and low is None and high is None and minutes is None
    assert speedup < 0.75 * min(ratios)  # against the cost window's fast plain minute: drift not cancelled


def test_a_ttft_budget_switches_speculation_off_even_in_a_cooldown_and_keeps_it_off_until_it_holds(tmp_path):
    """Budget 0.5 s: the class came on (a cooldown starts), then its speculating requests take 0.8 s
    to the first token at p95 while plain ones beside them take 0.3 s: off at the next run, cooldown or
    not.  Off, its goodput would bring it back, but the hour's speculating requests still break the
    budget (a few fast probes are too few to say); once enough probes are within it, it comes back on."""
    changes = []
    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), changes, speculation_enabled=False, n_min=1,
                                    n_max=3, cooldown_s=600, ttft_budget_s=0.5)  # fmt: skip
    start = now[0]

    def runs(k: int):
        for m in range(k):  # both sides measured every minute
            _steps(db, now[0] - 60 * (m + 1), {1: {0: 0.10, 3: 0.12}})
        (row,) = _tick(tuner)
        return row

    insert_records(db, _timed_records(40, start - 30, 0.05))
    row = runs(4)
    assert row["action"] == "on" and row["applied"], row["inputs"]["reason"]

    now[0] = start + 120  # in the cooldown
    insert_records(db, _timed_records(30, now[0] - 30, 0.8) + _timed_records(25, now[0] - 30, 0.3, n=0))
    row = runs(2)
    assert row["action"] == "off" and row["applied"] and row["n_after"] == 0, row["inputs"]["reason"]
    assert row["inputs"]["reason"].startswith("TTFT budget: p95 0.80 s") and "plain 0.30 s" in row["inputs"]["reason"]
    assert changes[-1].body["classes"]["qa"]["speculation_enabled"] is False

    now[0] = start + 120 + 660  # past the cooldown and the window, which holds no request at all
    row = runs(2)
    assert row["action"] == "keep" and not row["applied"], row["inputs"]["reason"]
    assert "TTFT budget: p95 0.80 s" in row["inputs"]["reason"]

    now[0] += 60  # ten fast probes
    insert_records(db, _timed_records(10, now[0] - 30, 0.05))
    row = runs(2)
    assert row["action"] == "keep" and not row["applied"], row["inputs"]["reason"]
    assert "probes predict" in row["inputs"]["reason"] and "TTFT budget: p95 0.80 s" in row["inputs"]["reason"]

    insert_records(db, _timed_records(30, now[0] - 20, 0.05))  # enough probes in the window, within the budget
    now[0] += 60
    row = runs(2)
    assert row["action"] == "on" and row["applied"], row["inputs"]["reason"]


@pytest.mark.parametrize("shifted", [False, True])
def test_an_n_explored_within_the_cost_window_is_not_explored_again_once_the_window_forgets_it(tmp_path, shifted):
    """N=2 was explored 40 minutes ago (its steps and its second position's acceptance are in the hour);
    the 5-minute window holds only N=1.  The tuner predicts N=2 from what it measured there and stays
    at N=1; before, the window's forgetting made N=2 "not measured yet" again and it explored it every
    few windows (live run 2026-12-06: every 30-110 s).  Where acceptance has just shifted, the hour is
    another regime and is not remembered."""
    db, tuner, now = _clocked_tuner(tmp_path, timedelta(minutes=1), n_min=1, n_max=2, num_speculative_tokens=1)
    _steps(db, now[0] - 2400, {1: {0: 0.10, 1: 0.13, 2: 0.17}}, steps=400)
    _steps(db, now[0] - 120, {1: {0: 0.10, 1: 0.13}}, steps=400)
    insert_records(db, _qa_records(40, [10, 10], [6, 3], now[0] - 2400, "explored"))
    if shifted:  # the last interval's first position is far above the window's
        insert_records(db, _qa_records(40, [10], [10], now[0] - 20, "shift"))
    insert_records(db, _qa_records(20, [10], [6], now[0] - 120, "window"))
    (row,) = tuner.run_once()
    positions = row["inputs"]["position_acceptance"]
    if shifted:
        assert row["inputs"]["recent_window_used"] and positions["from_history"] == []
        return
    hour = position_acceptance([400 + 200, 400], [240 + 120, 120])  # the explored records and the window's
    assert positions["from_history"] == [2] and positions["trials"] == [200, hour.samples[1]]
    assert positions["alpha"][1] == hour.mean[1]
    assert row["action"] != "explore" and row["n_after"] == 1, row["inputs"]["reason"]
    # The same store without the explored hour: N=2 is extrapolated from position 1 and explored.
    db2, tuner2, now2 = _clocked_tuner(tmp_path / "fresh", timedelta(minutes=1), n_min=1, n_max=2,
                                       num_speculative_tokens=1)  # fmt: skip
    _steps(db2, now2[0] - 2400, {1: {0: 0.10, 1: 0.13, 2: 0.17}}, steps=400)
    _steps(db2, now2[0] - 120, {1: {0: 0.10, 1: 0.13}}, steps=400)
    insert_records(db2, _qa_records(20, [10], [6], now2[0] - 120, "window"))
    (forgot,) = tuner2.run_once()
    assert forgot["action"] == "explore" and forgot["n_after"] == 2, forgot["inputs"]["reason"]


def test_an_explored_n_is_held_until_measured_then_decided_on(tmp_path):
    """One interval is too short to measure an explored N where traffic is slow: the tuner holds it
    (a "keep" that says what is missing) instead of judging its extrapolation again, and decides once
    its last position has its trials."""
    db, tuner, now = _clocked_tuner(tmp_path, timedelta(seconds=10), n_min=1, n_max=2, num_speculative_tokens=1)
    _steps(db, now[0] - 2400, {1: {0: 0.10, 1: 0.13, 2: 0.17}}, steps=400)
    _steps(db, now[0] - 120, {1: {0: 0.10, 1: 0.13}}, steps=400)
    insert_records(db, _qa_records(20, [10], [6], now[0] - 120, "window"))
    (explored,) = tuner.run_once()
    assert explored["action"] == "explore" and explored["applied"] and explored["n_after"] == 2

    for _ in range(3):  # nothing measured at N=2 yet: held, whatever the model now says of it
        now[0] += 10
        (held,) = tuner.run_once()
        assert held["action"] == "keep" and not held["applied"] and held["n_after"] == 2, held["inputs"]["reason"]
        assert (
            held["inputs"]["reason"].startswith("exploring N=2")
            and "position 2 has 0 of 30" in held["inputs"]["reason"]
        )

    insert_records(db, _qa_records(10, [10, 10], [6, 3], now[0] - 5, "explored"))  # 60 trials at position 2
    now[0] += 10
    (decided,) = tuner.run_once()
    assert not decided["inputs"]["reason"].startswith("exploring"), decided["inputs"]["reason"]
    assert decided["inputs"]["position_acceptance"]["trials"][1] >= 30


@pytest.mark.parametrize(("budget", "began_s"), [(0.001, 60), (0.5, 60), (0.5, 20), (0.0, 60)])
def test_an_exploration_is_paid_from_the_explore_budget(tmp_path, budget, began_s):
    """N=2 is unmeasured and within the explore margin of N=1, so the tuner would explore it.  N=2 was
    explored before, for 40 s (or until 10 s ago), and by the model it cost about 1 % of tokens/s
    against N=1: a budget of 0.1 % has not repaid that 60 s later (the row says how long the next
    exploration waits), 50 % has; none explores within three intervals (30 s) of the last
    exploration; a budget of 0 never explores."""
    plain_above_1 = [BatchRange(min_batch=2, max_batch=4096, num_speculative_tokens=0)]  # as decided before
    db, tuner, now = _clocked_tuner(tmp_path, timedelta(seconds=10), n_min=1, n_max=2, num_speculative_tokens=1,
                                    explore_budget=budget, batch_table=plain_above_1)  # fmt: skip
    _steps(db, now[0] - 120, {1: {0: 0.10, 1: 0.13}}, steps=400)
    insert_records(db, _qa_records(20, [10], [6], now[0] - 120, "window"))
    at = lambda s: datetime.fromtimestamp(now[0] - s, UTC)  # noqa: E731
    past = dict(instance_id="*", prompt_class="qa", batch_bucket=1, mode="auto", inputs={}, applied=True)
    with db.begin() as conn:
        conn.execute(insert(TunerDecision), [
            dict(past, at=at(began_s), action="explore", n_before=1, n_after=2),
            dict(past, at=at(max(began_s - 40, 10)), action="set_n", n_before=2, n_after=1),
        ])  # fmt: skip
    (row,) = tuner.run_once()
    reason = row["inputs"]["reason"]
    if (budget, began_s) == (0.5, 60):
        assert row["action"] == "explore" and row["applied"] and row["n_after"] == 2, reason
        return
    assert row["action"] == "keep" and not row["applied"] and row["n_after"] == 1, reason
    if budget == 0.0:
        assert reason.endswith("; not exploring N=2: explore_budget is 0"), reason
    elif began_s == 20:
        assert reason.endswith("; not exploring N=2: the last exploration began 20 s ago (at most one per 30 s)")
    else:
        assert "; not exploring N=2: the next exploration waits " in reason and "for 40 s, repaid at" in reason
