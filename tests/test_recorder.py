"""The recorder lands every record exactly once: through outages, restarts
and kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from spectune.engine.schema import StepRecord
from spectune.store.db import make_engine, upgrade
from spectune.store.models import RequestRecordRow, StepStat
from spectune.store.recorder import Recorder
from spectune.store.steps import StepAggregator, batch_bucket

from records import make_records
from servers import wait_for


def _rows(url: str) -> list[RequestRecordRow]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(RequestRecordRow)).all())
    finally:
        engine.dispose()


def test_records_round_trip(db_url, tmp_path):
    upgrade(db_url)
    records = make_records(1000)
    recorder = Recorder(make_engine(db_url), tmp_path / "spool")
    for r in records:
        recorder.submit(r)
    assert recorder.close(), "not everything was shipped"
    rows = {row.request_id: row for row in _rows(db_url)}
    assert len(rows) == 1000 and recorder.stats.dropped == 0
    sample = records[17]
    row = rows[sample.request_id]
    assert row.accepted_per_position == sample.accepted_per_position
    assert row.num_accepted_tokens == sample.num_accepted_tokens and row.prompt_class == sample.prompt_class
    assert row.finish_time.timestamp() == pytest.approx(sample.finish_time)
    assert list((tmp_path / "spool").glob("*.jsonl")) == []  # shipped segments are deleted


def test_a_line_written_just_before_a_rotation_is_shipped_not_deleted(tmp_path, monkeypatch):
    """The writer appends and rotates between the shipper's empty read and its look for a later
    segment (a race CI hit: close() said all shipped, the rows were never written).  Forced here:
    the spool appends and seals the moment the shipper, after an empty read, lists the segments."""
    from spectune.store import recorder as recorder_module
    from spectune.store.spool import Spool

    (record,) = make_records(1, prefix="raced")

    class RacingSpool(Spool):
        armed, fired, last_read_empty = False, threading.Event(), False

        def read(self, cursor, max_items):
            items, after = super().read(cursor, max_items)
            self.last_read_empty = not items
            return items, after

        def segments(self):
            racing = self.armed and self.last_read_empty and not self.fired.is_set()
            if racing and threading.current_thread().name == "recorder-shipper":
                self.append([{"kind": "request", **record.__dict__}])
                self.seal()
                self.fired.set()
            return super().segments()

    monkeypatch.setattr(recorder_module, "Spool", RacingSpool)
    url = f"sqlite:///{tmp_path}/spectune.db"
    upgrade(url)
    recorder = Recorder(make_engine(url), tmp_path / "spool")
    recorder.spool.armed = True
    assert recorder.spool.fired.wait(60), "the shipper never listed the segments after an empty read"
    assert recorder.close()
    assert [row.request_id for row in _rows(url)] == ["raced-0"]


def test_replaying_the_same_records_never_duplicates(db_url, tmp_path):
    upgrade(db_url)
    records = make_records(300)
    for _ in range(2):
        recorder = Recorder(make_engine(db_url), tmp_path / "spool")
        for r in records:
            recorder.submit(r)
        recorder.close()
    assert len(_rows(db_url)) == 300


def test_postgres_outage_loses_nothing(pg_server, tmp_path):
    pg_server.reset()
    upgrade(pg_server.url)
    records = make_records(1000, prefix="outage")
    recorder = Recorder(make_engine(pg_server.url, pool_pre_ping=True), tmp_path / "spool", max_backoff=0.5)

    def feed():
        for _i, r in enumerate(records):
            recorder.submit(r)
            time.sleep(0.003)  # ~3 s of traffic

    feeder = threading.Thread(target=feed)
    feeder.start()
    wait_for(lambda: recorder.stats.shipped > 0, 120, "a record reaching the database before the outage", poll=0.05)
    pg_server.stop()
    wait_for(lambda: not recorder.stats.db_up, 120, "the recorder seeing the outage", poll=0.05)
    pg_server.start()
    feeder.join()
    recorder.close(timeout=30)
    rows = _rows(pg_server.url)
    assert sorted(r.request_id for r in rows) == sorted(r.request_id for r in records)
    assert recorder.stats.db_errors > 0


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from records import make_records
    from spectune.store.db import make_engine
    from spectune.store.recorder import Recorder
    recorder = Recorder(make_engine({url!r}), {spool!r})
    for r in make_records(500, prefix="k9"):
        recorder.submit(r)
    print("SUBMITTED", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("db_reachable", [False, True])
def test_kill_9_then_restart_replays_the_spool(tmp_path, db_reachable):
    url = f"sqlite:///{tmp_path}/s.db"
    upgrade(url)
    child_url = url if db_reachable else "postgresql+psycopg://postgres@127.0.0.1:9/none"
    spool = str(tmp_path / "spool")
    script = CHILD.format(tests=os.path.dirname(__file__), url=child_url, spool=spool)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "SUBMITTED"
    proc.send_signal(signal.SIGKILL)  # at once: submit() has handed every record to the OS
    proc.wait()
    recorder = Recorder(make_engine(url), spool)
    recorder.close(timeout=30)
    ids = [r.request_id for r in _rows(url)]
    assert len(ids) == len(set(ids)) == 500


def test_step_aggregation():
    agg = StepAggregator()
    t0 = 1_800_000_000.0  # on a minute boundary
    for i in range(10):
        agg.add(
            StepRecord(
                instance_id="i",
                time=t0 + i,
                batch_size=3,
                num_prefill_requests=0,
                num_decode_requests=3,
                num_scheduled_tokens=12,
                step_time_s=0.01 * (i + 1),
                num_speculative_tokens=3,
                num_draft_tokens=9,
                num_accepted_tokens=6,
                accepted_per_position=[3, 2, 1],
            )
        )
    # a step that also prefills is not a decode step: counted apart, under the N of the last decode
    # step (it verified nothing, so it would pass for N=0 with speculation on)
    prefill = StepRecord(instance_id="i", time=t0 + 11, batch_size=3, num_prefill_requests=1, num_decode_requests=2,
                         num_scheduled_tokens=200, step_time_s=0.5, num_speculative_tokens=0)  # fmt: skip
    agg.add(prefill)
    # an instance with no decode step yet: its prefill counts as off
    agg.add(prefill.model_copy(update={"instance_id": "j", "batch_size": 1, "num_decode_requests": 0}))
    # a step where only one of three requests verified drafts (the others demoted) counts at its N:
    # the drafter ran over all three
    partial = prefill.model_copy(update={"num_prefill_requests": 0, "num_decode_requests": 3, "num_drafts": 1,
                                          "num_speculative_tokens": 3, "step_time_s": 0.011,
                                          "num_accepted_tokens": 1})  # fmt: skip
    agg.add(partial)
    assert agg.flush(now=t0 + 30) == []  # minute still open
    row, other = sorted(agg.flush(now=t0 + 61), key=lambda r: r["instance_id"])
    assert (row["batch_bucket"], row["steps"], row["num_accepted_tokens"]) == (4, 11, 61)
    assert (row["num_speculative_tokens"], row["prefill_steps"], row["prefill_time_sum_s"]) == (3, 1, 0.5)
    assert row["prefill_generated_tokens"] == 2  # the two decoding requests' tokens
    off = (other["num_speculative_tokens"], other["batch_bucket"], other["steps"], other["prefill_steps"])
    assert off == (0, 1, 0, 1)
    assert row["step_time_p50_s"] == pytest.approx(0.05) and row["step_time_p95_s"] == pytest.approx(0.10)
    assert row["accepted_per_position"] == [30, 20, 10]
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def _decode_step(t: float, step_time_s: float = 0.02) -> StepRecord:
    return StepRecord(instance_id="i", time=t, batch_size=2, num_prefill_requests=0, num_decode_requests=2,
                      num_scheduled_tokens=8, step_time_s=step_time_s, num_speculative_tokens=3,
                      num_draft_tokens=6, num_accepted_tokens=4, accepted_per_position=[2, 1, 1])  # fmt: skip


def test_open_minute_snapshots_carry_running_totals_once_per_change():
    agg = StepAggregator()
    t0 = 1_800_000_000.0
    agg.add(_decode_step(t0 + 1))
    (first,) = agg.flush(now=t0 + 2, snapshot_open=True)
    assert first["steps"] == 1
    assert agg.flush(now=t0 + 3, snapshot_open=True) == []  # nothing new: no row
    agg.add(_decode_step(t0 + 4, 0.04))
    (second,) = agg.flush(now=t0 + 5, snapshot_open=True)
    assert (second["steps"], second["step_time_sum_s"], second["num_accepted_tokens"]) == (2, pytest.approx(0.06), 8)
    assert agg.flush(now=t0 + 61) == []  # closed with no steps after its last snapshot: already final
    agg.add(_decode_step(t0 + 62))
    agg.add(_decode_step(t0 + 63))
    assert agg.flush(now=t0 + 64) == []  # no snapshot asked for, minute open
    (closed,) = agg.flush(now=t0 + 121)
    assert closed["steps"] == 2 and closed["minute"] == t0 + 60


def test_the_tuner_sees_the_open_minute_and_newer_totals_replace_older(db_url, tmp_path):
    from spectune.store.db import upsert_step_stats

    upgrade(db_url)
    db = make_engine(db_url)
    recorder = Recorder(db, tmp_path / "spool", step_snapshot_interval=0.2)
    now = time.time()
    if now % 60 > 50:  # keep both steps inside one open minute
        time.sleep(61 - now % 60)
        now = time.time()

    def stored_steps() -> int:
        with db.connect() as conn:
            return conn.execute(select(StepStat.steps)).scalar() or 0

    recorder.submit_step(_decode_step(now))
    wait_for(lambda: stored_steps() == 1, 120, "step stats reaching 1 step", poll=0.05)
    recorder.submit_step(_decode_step(now + 1))
    wait_for(lambda: stored_steps() == 2, 120, "step stats reaching 2 steps", poll=0.05)
    with db.connect() as conn:
        (row,) = conn.execute(select(StepStat.__table__)).mappings().all()
    stale = {**row, "steps": 1, "step_time_sum_s": 0.02}
    with db.begin() as conn:  # a replayed older snapshot (a spool replay after a restart) changes nothing
        upsert_step_stats(conn, [stale])
        upsert_step_stats(conn, [stale, {**row, "steps": 3}, stale])  # one statement, one key: the newest wins
    assert stored_steps() == 3
    assert recorder.close()


def test_step_stats_reach_the_database(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    upgrade(url)
    recorder = Recorder(make_engine(url), tmp_path / "spool")
    recorder.submit_step(
        StepRecord(
            instance_id="i",
            time=time.time(),
            batch_size=2,
            num_prefill_requests=0,
            num_decode_requests=2,
            num_scheduled_tokens=8,
            step_time_s=0.02,
            num_speculative_tokens=3,
            num_draft_tokens=6,
            num_accepted_tokens=4,
            accepted_per_position=[2, 1, 1],
        )
    )
    recorder.close()
    engine = make_engine(url)
    with engine.connect() as conn:
        row = conn.execute(select(StepStat)).one()
        assert row.steps == 1 and row.batch_bucket == 2 and row.writer == recorder.writer
        assert row.minute <= datetime.now(UTC)


def test_sampled_prompts_go_to_their_own_table_and_expire(tmp_path):
    from datetime import timedelta

    from spectune.store.models import SampledPrompt
    from spectune.store.retention import expire_prompts

    url = f"sqlite:///{tmp_path}/s.db"
    upgrade(url)
    sampled, plain = make_records(2, prefix="p")
    sampled = sampled.model_copy(update={"prompt_text": "secret prompt", "completion_text": "answer"})
    recorder = Recorder(make_engine(url), tmp_path / "spool", prompt_retention=timedelta(hours=1))
    recorder.submit(sampled)
    recorder.submit(plain)
    assert recorder.close()
    db = make_engine(url)
    with db.connect() as conn:
        rows = conn.execute(select(SampledPrompt.__table__)).all()
    assert [(r.request_id, r.prompt, r.completion) for r in rows] == [(sampled.request_id, "secret prompt", "answer")]
    assert len(_rows(url)) == 2  # both records, without any prompt text
    assert expire_prompts(db, now=datetime.now(UTC)) == 0
    assert expire_prompts(db, now=rows[0].expires_at + timedelta(seconds=1)) == 1
    db.dispose()
