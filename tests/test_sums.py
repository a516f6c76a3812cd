"""Sums per minute, hour and day equal the records they cover: written once per record (replays add
nothing), converted from the previous schema's rows without loss (retention keeping them:
test_retention); a range splits into the fewest whole periods."""

from __future__ import annotations

import itertools
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from spectune.store.aggregates import acceptance_by_class
from spectune.store.db import downgrade, insert_ignoring_duplicates, insert_records, make_engine, record_row, upgrade
from spectune.store.models import RequestRecordRow
from spectune.store.sums import WIDTHS, decompose, period_start

from records import NOW, TOTALS, make_records, spread_records, stored_sums


def _want(records, extra=()) -> tuple[dict, dict]:
    """Brute force at every width: totals per key, (drafted, accepted) per key and position; ``extra``
    rows (minute, instance, class, N, totals, drafted, accepted) add to them as records would."""
    totals: dict[tuple, list] = defaultdict(lambda: [0] * len(TOTALS))
    positions: dict[tuple, list] = defaultdict(lambda: [0, 0])
    items = [
        (datetime.fromtimestamp(r.finish_time, UTC), r.instance_id, r.prompt_class, r.num_speculative_tokens,
         (1, r.num_draft_tokens > 0, r.finish_reason == "error", r.output_tokens, r.num_spec_steps,
          r.num_draft_tokens, r.num_accepted_tokens),
         r.drafted_per_position if r.num_draft_tokens else [], r.accepted_per_position)
        for r in records
    ]  # fmt: skip
    for at, instance, cls, n, values, drafted, accepted in [*items, *extra]:
        for width in WIDTHS:
            key = (width, period_start(at, width), instance, cls, n)
            totals[key] = [a + b for a, b in zip(totals[key], values, strict=True)]
            for i, d in enumerate(drafted):
                positions[(*key, i)][0] += d
                positions[(*key, i)][1] += accepted[i] if i < len(accepted) else 0
    return dict(totals), dict(positions)


def test_each_record_is_summed_once_however_often_it_is_written(db_url):
    upgrade(db_url)
    db = make_engine(db_url)
    records = spread_records(make_records(300, seed=1))
    assert insert_records(db, records[:200]) == 200
    # a replay of 100 stored records with 100 new ones, one of them twice in the batch
    assert insert_records(db, [*records[100:], records[250]]) == 100
    assert insert_records(db, records) == 0
    assert stored_sums(db) == _want(records)
    db.dispose()


def test_rows_of_the_previous_schema_are_converted_and_restored(db_url):
    upgrade(db_url, "0004")
    db = make_engine(db_url)
    records = spread_records(make_records(120, seed=2))
    insert_ignoring_duplicates(db, RequestRecordRow.__table__, [record_row(r.model_dump()) for r in records])
    types = {
        "minute": sa.DateTime(timezone=True),
        "drafted_per_position": sa.JSON(),
        "accepted_per_position": sa.JSON(),
    }
    rollups = sa.table("request_rollups", *(sa.column(c, types.get(c)) for c in (
        "instance_id", "prompt_class", "num_speculative_tokens", "minute", "requests", "errors", "output_tokens",
        "num_spec_steps", "num_draft_tokens", "num_accepted_tokens", "drafted_per_position", "accepted_per_position",
        "ttft_s_sum", "e2e_s_sum")))  # fmt: skip
    boundary = datetime.fromtimestamp(records[0].finish_time, UTC).replace(second=0, microsecond=0)
    old = [  # retention's rollups of deleted records: two days back, and one in a minute records still share
        dict(instance_id="a", prompt_class="qa", num_speculative_tokens=4, minute=NOW - timedelta(days=2),
             requests=10, errors=1, output_tokens=400, num_spec_steps=50, num_draft_tokens=120,
             num_accepted_tokens=70, drafted_per_position=[40, 40, 40], accepted_per_position=[30, 25, 15],
             ttft_s_sum=0.5, e2e_s_sum=10.0),
        dict(instance_id=records[0].instance_id, prompt_class=records[0].prompt_class, num_speculative_tokens=4,
             minute=boundary, requests=3, errors=0, output_tokens=120, num_spec_steps=9, num_draft_tokens=36,
             num_accepted_tokens=20, drafted_per_position=[9, 9, 9, 9], accepted_per_position=[8, 6, 4, 2],
             ttft_s_sum=0.15, e2e_s_sum=3.0),
    ]  # fmt: skip
    with db.begin() as conn:
        conn.execute(sa.insert(rollups), old)
    db.dispose()

    upgrade(db_url)
    db = make_engine(db_url)
    extra = [(r["minute"], r["instance_id"], r["prompt_class"], r["num_speculative_tokens"],
              (r["requests"], r["requests"], r["errors"], r["output_tokens"], r["num_spec_steps"],
               r["num_draft_tokens"], r["num_accepted_tokens"]),
              r["drafted_per_position"], r["accepted_per_position"]) for r in old]  # fmt: skip
    want_totals, want_positions = _want(records, extra)
    assert stored_sums(db) == (want_totals, want_positions)
    got = acceptance_by_class(db, NOW - timedelta(days=3), NOW + timedelta(minutes=1))
    assert sum(g.requests for g in got.values()) == len(records) + 13
    assert sum(g.accepted for g in got.values()) == sum(r.num_accepted_tokens for r in records) + 90
    db.dispose()

    downgrade(db_url, "0004")  # the rollups come back as they were; records are untouched
    db = make_engine(db_url)
    with db.connect() as conn:
        back = [dict(m) for m in conn.execute(sa.select(rollups)).mappings()]
        assert conn.execute(sa.select(sa.func.count()).select_from(RequestRecordRow)).scalar() == len(records)
    for row in back:
        row["minute"] = row["minute"].replace(tzinfo=UTC) if row["minute"].tzinfo is None else row["minute"]
    key = lambda r: (r["minute"], r["instance_id"])  # noqa: E731
    sums = ("ttft_s_sum", "e2e_s_sum")  # what the records add is subtracted again: floats, not exact
    for got, want in zip(sorted(back, key=key), sorted(old, key=key), strict=True):
        assert {k: v for k, v in got.items() if k not in sums} == {k: v for k, v in want.items() if k not in sums}
        assert [got[k] for k in sums] == pytest.approx([want[k] for k in sums])
    db.dispose()
    upgrade(db_url)
    db = make_engine(db_url)
    assert stored_sums(db) == (want_totals, want_positions)
    db.dispose()


def test_a_range_reads_the_widest_whole_periods_and_raw_records_only_at_its_edges():
    t = lambda *hms: datetime(2026, 6, 1, *hms, tzinfo=UTC)  # noqa: E731
    now = datetime(2026, 6, 9, 10, 30, 20, tzinfo=UTC)
    week = decompose(t(10, 17, 30), None, now)
    assert week.raw == [(t(10, 17, 30), t(10, 18)), (datetime(2026, 6, 9, 10, 30, tzinfo=UTC), None)]
    assert week.periods == [
        (60, t(10, 18), t(11)), (60, datetime(2026, 6, 9, 10, tzinfo=UTC), datetime(2026, 6, 9, 10, 30, tzinfo=UTC)),
        (3600, t(11), datetime(2026, 6, 2, tzinfo=UTC)), (3600, datetime(2026, 6, 9, tzinfo=UTC),
                                                           datetime(2026, 6, 9, 10, tzinfo=UTC)),
        (86400, datetime(2026, 6, 2, tzinfo=UTC), datetime(2026, 6, 9, tzinfo=UTC)),
    ]  # fmt: skip
    inside_a_minute = decompose(t(10, 17, 30), t(10, 17, 50), now)
    assert inside_a_minute.raw == [(t(10, 17, 30), t(10, 17, 50))] and inside_a_minute.periods == []
    aligned = decompose(t(10), t(12), now)
    assert aligned.raw == [] and aligned.periods == [(3600, t(10), t(12))]
    # every instant of the range is covered exactly once
    for since, until in ((t(10, 17, 30), None), (t(0, 0, 1), t(23, 59, 59)), (t(10), t(10, 0, 30))):
        parts = decompose(since, until, now)
        pieces = sorted([(a, b or now) for a, b in parts.raw] + [(a, b) for _, a, b in parts.periods])
        assert pieces[0][0] == since and pieces[-1][1] == (until or now)
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(pieces))
