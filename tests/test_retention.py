"""Old records become per-minute rollups; nothing is counted twice."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.models import RequestRecordRow, RequestRollup
from spectune.store.retention import roll_up

from records import make_records


def test_roll_up_preserves_totals(db_url):
    upgrade(db_url)
    db = make_engine(db_url)
    records = make_records(500)
    insert_records(db, records)
    now = datetime.fromtimestamp(max(r.finish_time for r in records), UTC) + timedelta(days=8)
    # roll up in two passes (small chunks) and once more: idempotent
    assert roll_up(db, timedelta(days=7), now=now, chunk=120) == 500
    assert roll_up(db, timedelta(days=7), now=now) == 0
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(RequestRecordRow)).scalar() == 0
        rollups = conn.execute(select(RequestRollup.__table__)).all()
    assert sum(r.requests for r in rollups) == 500
    assert sum(r.num_accepted_tokens for r in rollups) == sum(r.num_accepted_tokens for r in records)
    per_pos = [sum(r.accepted_per_position[i] for r in rollups) for i in range(4)]
    assert per_pos == [sum(r.accepted_per_position[i] for r in records) for i in range(4)]
    assert {r.prompt_class for r in rollups} == {"qa", "long"}
    db.dispose()


def test_recent_records_stay(db_url):
    upgrade(db_url)
    db = make_engine(db_url)
    insert_records(db, make_records(50))
    assert roll_up(db, timedelta(days=7)) == 0
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(RequestRecordRow)).scalar() == 50
    db.dispose()
