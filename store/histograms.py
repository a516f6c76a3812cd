"""Latency histograms per hour and class, for percentiles over ranges too long to sort.

Log-spaced buckets of ratio ``GAMMA``: a value v > 0 falls in bucket floor(log v / log GAMMA)
and is reported as the point of its bucket with the least relative error, so a percentile read
from a histogram is within ``RELATIVE_ERROR`` (about 1 %) of the exact nearest-rank value it
stands for (the rank itself is exact; DDSketch's guarantee).  Zero and negative values have a
bucket of their own, reported as 0.

The histograms are fleet-wide (no instance in the key) and written by ``refresh`` only: it
recomputes an hour from its raw records whenever the hour's count differs from what the
request sums (``store.sums``, exact by construction) say it holds -- the current hour, an hour
a late record landed in, one never computed.  A read uses an hour's histogram only where its
count equals the sums' count, and the raw records otherwise: a histogram is never stale in an
answer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, Engine, delete, func, insert, select
from sqlalchemy.exc import IntegrityError

from .models import LatencyHistogram, RequestRecordRow, RequestSum
from .sums import period_start, request_totals

GAMMA = 1.02
RELATIVE_ERROR = (GAMMA - 1) / (GAMMA + 1)
ZERO = -(10**6)  # the bucket of values <= 0
HOUR = 3600
METRICS = ("ttft_s", "tpot_s", "e2e_s")


def bucket_of(value: float) -> int:
    return math.floor(math.log(value) / math.log(GAMMA)) if value > 0 else ZERO


def value_of(bucket: int) -> float:
    """The point of [GAMMA^b, GAMMA^(b+1)) with the least worst-case relative error."""
    return 0.0 if bucket == ZERO else 2 * GAMMA ** (bucket + 1) / (GAMMA + 1)


def nearest_rank(counts: Counter[int], q: float) -> float | None:
    """The nearest-rank percentile q of the values counted in ``counts`` (None: no values)."""
    total = sum(counts.values())
    if not total:
        return None
    rank, seen = max(1, math.ceil(q * total)), 0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen >= rank:
            return value_of(bucket)
    raise AssertionError("unreachable: the ranks add up to the total")


def histograms_of(rows: Iterable[Sequence]) -> dict[tuple[str, str], Counter[int]]:
    """{(class, metric): bucket counts} of (class, ttft_s, tpot_s, e2e_s) rows (None values skipped)."""
    out: dict[tuple[str, str], Counter[int]] = {}
    for cls, *values in rows:
        for metric, value in zip(METRICS, values, strict=True):
            if value is not None:
                out.setdefault((cls, metric), Counter())[bucket_of(value)] += 1
    return out


def _hour_counts(conn: Connection, since: datetime, until: datetime) -> dict[tuple[datetime, str], int]:
    """{(hour start, class): requests} over the fleet, from the exact request sums."""
    S = RequestSum
    query = (
        select(S.start, S.prompt_class, func.sum(S.requests))
        .where(S.width_s == HOUR, S.start >= since, S.start < until)
        .group_by(S.start, S.prompt_class)
    )
    return {(start, cls): int(n) for start, cls, n in conn.execute(query)}


def _histogram_counts(conn: Connection, since: datetime, until: datetime) -> dict[tuple[datetime, str], int]:
    H = LatencyHistogram
    query = select(H.start, H.prompt_class, func.max(H.requests)).where(H.start >= since, H.start < until)
    return {(start, cls): int(n) for start, cls, n in conn.execute(query.group_by(H.start, H.prompt_class))}


def fresh_hours(conn: Connection, since: datetime, until: datetime) -> dict[tuple[datetime, str], int]:
    """{(hour, class): requests} of the hours in [since, until) whose histograms hold exactly what
    the sums say the hour holds."""
    expected = _hour_counts(conn, since, until)
    have = _histogram_counts(conn, since, until)
    return {key: n for key, n in expected.items() if have.get(key) == n}


def refresh(db: Engine, since: datetime, until: datetime) -> int:
    """Recompute, from raw records, every hour starting in [since, until) whose histograms do not
    match the sums; one transaction per hour.  ``since`` no earlier than the records' retention
    (older raw records are gone), ``until`` no later than the current hour's start (an open hour
    is read raw).  Another process refreshing the same hour at once wins; returns how many hours
    this call recomputed."""
    with db.connect() as conn:
        expected = _hour_counts(conn, since, until)
        have = _histogram_counts(conn, since, until)
    stale = sorted({key[0] for key, n in expected.items() if have.get(key) != n})
    done = 0
    for start in stale:
        try:
            with db.begin() as conn:
                _recompute(conn, start)
            done += 1
        except IntegrityError:  # a concurrent refresh inserted the same hour first: it is current
            continue
    return done


def _recompute(conn: Connection, start: datetime) -> None:
    R, H = RequestRecordRow, LatencyHistogram
    end = start + timedelta(seconds=HOUR)
    raw = conn.execute(
        select(R.prompt_class, R.ttft_s, R.tpot_s, R.e2e_s).where(R.finish_time >= start, R.finish_time < end)
    ).all()
    requests = Counter(row[0] for row in raw)
    conn.execute(delete(H).where(H.start == start))
    rows = [
        dict(start=start, prompt_class=cls, metric=metric, requests=requests[cls],
             counts={str(b): n for b, n in sorted(counts.items())})
        for (cls, metric), counts in histograms_of(raw).items()
    ]  # fmt: skip
    if rows:  # every record has an e2e_s: each class of the hour has a row with its count
        conn.execute(insert(H), rows)


def refresh_closed_hours(db: Engine, retention: timedelta, now: datetime) -> int:
    """The scheduled job: every closed hour the records' retention still covers."""
    from .retention import records_deleted_before  # retention imports nothing from here

    horizon = max(now - retention, records_deleted_before(db) or now - retention)
    first = period_start(horizon, HOUR) + timedelta(seconds=HOUR)  # the first hour with all its records
    return refresh(db, first, period_start(now, HOUR))


def histogram_latency(
    db: Engine, since: datetime, until: datetime | None, prompt_class: str | None, quantiles
) -> dict[str, dict]:
    """``aggregates.latency_by_class`` over a long range: closed hours from their histograms where
    those match the sums, the rest (edges, the open hour, hours not yet computed) from the records,
    bucketed alike; requests and output tokens exact from the sums."""
    now = datetime.now(UTC)
    end = min(until, now) if until is not None else now
    first = period_start(since, HOUR)
    first = first if first == since else first + timedelta(seconds=HOUR)
    last = max(first, period_start(end, HOUR))
    merged: dict[tuple[str, str], Counter[int]] = {}
    R, H = RequestRecordRow, LatencyHistogram
    with db.connect() as conn:
        fresh = fresh_hours(conn, first, last)
        query = select(H.start, H.prompt_class, H.metric, H.counts).where(H.start >= first, H.start < last)
        if prompt_class is not None:
            query = query.where(H.prompt_class == prompt_class)
        for start, cls, metric, counts in conn.execute(query):
            if (start, cls) in fresh:
                merged.setdefault((cls, metric), Counter()).update({int(b): n for b, n in counts.items()})
        # everything not in a fresh histogram: the edges, and each (hour, class) not fresh
        raw = select(R.prompt_class, R.ttft_s, R.tpot_s, R.e2e_s)
        if prompt_class is not None:
            raw = raw.where(R.prompt_class == prompt_class)
        pieces = [raw.where(R.finish_time >= since, R.finish_time < first)]
        pieces.append(raw.where(R.finish_time >= last) if until is None else
                      raw.where(R.finish_time >= last, R.finish_time < until))  # fmt: skip
        stale: dict[datetime, list[str]] = {}
        for start, cls in _hour_counts(conn, first, last):
            if (start, cls) not in fresh and (prompt_class is None or cls == prompt_class):
                stale.setdefault(start, []).append(cls)
        for start, classes in stale.items():
            end_of = start + timedelta(seconds=HOUR)
            pieces.append(raw.where(R.finish_time >= start, R.finish_time < end_of, R.prompt_class.in_(classes)))
        for piece in pieces:
            for key, counts in histograms_of(conn.execute(piece)).items():
                merged.setdefault(key, Counter()).update(counts)
    out: dict[str, dict] = {}
    for cls, (requests, tokens) in request_totals(db, since, until, prompt_class).items():
        out[cls] = {"requests": requests, "output_tokens": tokens, "percentile_error": RELATIVE_ERROR}
        for metric in METRICS:
            counts = merged.get((cls, metric), Counter())
            out[cls][metric] = {name: nearest_rank(counts, q) for name, q in quantiles}
    return out
