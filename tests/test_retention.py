"""Retention deletes old records in short transactions; every count stays in the minute sums."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from spectune.store.aggregates import acceptance_by_class
from spectune.store.db import insert_records, make_engine, upgrade
from spectune.store.models import RequestRecordRow
from spectune.store.retention import expire_records, expire_sums, left_out

from records import NOW, make_records, spread_records, stored_sums


def _count(db) -> int:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(RequestRecordRow)).scalar()


def test_retention_deletes_records_in_chunks_and_every_count_stays(db_url):
    upgrade(db_url)
    db = make_engine(db_url)
    records = spread_records(make_records(400, seed=3))
    insert_records(db, records)
    since, until = NOW - timedelta(hours=3), NOW + timedelta(minutes=1)
    before = acceptance_by_class(db, since, until)
    stored = stored_sums(db)
    # everything older than 30 minutes before NOW goes, 64 per transaction
    cutoff = NOW - timedelta(minutes=30)
    old = sum(datetime.fromtimestamp(r.finish_time, UTC) < cutoff for r in records)
    assert expire_records(db, timedelta(minutes=30), now=NOW, chunk=64) == old > 64
    assert expire_records(db, timedelta(minutes=30), now=NOW) == 0
    assert _count(db) == len(records) - old
    assert stored_sums(db) == stored
    # what a read cannot count is said: a partial first minute before the horizon, or (raw-only reads)
    # everything before it
    assert left_out(db, since) is None  # since is a whole minute
    assert "partial first minute" in left_out(db, since + timedelta(seconds=30))
    assert "not counted" in left_out(db, since, raw_only=True)
    assert left_out(db, cutoff + timedelta(seconds=30), raw_only=True) is None
    after = acceptance_by_class(db, since, until)  # whole minutes: from the sums
    assert {c: vars(g) for c, g in after.items()} == {c: vars(g) for c, g in before.items()}
    # the sums' own retention
    everything, _ = stored_sums(db)
    assert expire_sums(db, timedelta(hours=1), now=NOW) > 0
    left, positions = stored_sums(db)
    ended = lambda key: key[1] + timedelta(seconds=key[0]) < NOW - timedelta(hours=1)  # noqa: E731
    assert left == {k: v for k, v in everything.items() if not ended(k)} and any(map(ended, everything))
    assert not any(ended(k) for k in positions)
    db.dispose()


def test_recent_records_stay(db_url):
    upgrade(db_url)
    db = make_engine(db_url)
    insert_records(db, make_records(50))
    assert expire_records(db, timedelta(days=7)) == 0
    assert _count(db) == 50
    db.dispose()
