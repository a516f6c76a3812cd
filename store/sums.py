"""Sums of request records per minute, hour and day, kept equal to the records by construction.

Records enter the store only through ``insert_new_records``: one transaction inserts the
records (a replayed one is skipped) and adds exactly the new ones to ``request_sums`` and
``request_sum_positions`` at every width in ``WIDTHS``.  So at every moment a period's
sums equal the records finished in it that were ever stored -- also after retention
deleted them -- and a read over a range takes its whole days, then whole hours, then
whole minutes from the sums and only the partial minutes at its edges from raw records
(``decompose``): a 7-day read touches at most 6 days, 46 hours and 118 minutes of sums.

The key includes the instance: each engine's shipper adds to its own rows only, so a
fleet's writers never wait on each other's locks.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, func, or_, select, text

from .db import conflict_insert
from .models import RequestRecordRow, RequestSum, RequestSumPosition

WIDTHS = (60, 3600, 86400)  # minute, hour, day (each a multiple of the one before)
KEY = ("width_s", "start", "instance_id", "prompt_class", "num_speculative_tokens")
SUMMED = ("output_tokens", "num_spec_steps", "num_draft_tokens", "num_accepted_tokens")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def period_start(t: datetime, width_s: int) -> datetime:
    """Start of the ``width_s`` period ``t`` is in (periods aligned to the Unix epoch, UTC)."""
    aware = t if t.tzinfo is not None else t.replace(tzinfo=UTC)
    seconds = (aware - EPOCH) // timedelta(seconds=1)
    start = EPOCH + timedelta(seconds=seconds - seconds % width_s)
    return start if t.tzinfo is not None else start.replace(tzinfo=None)  # naive in, naive out (SQLite reads)


def record_sums(rows: Iterable[Mapping[str, Any]], widths: Sequence[int] = WIDTHS) -> tuple[list[dict], list[dict]]:
    """(request_sums rows, request_sum_positions rows) summing request_records rows at each width."""
    totals: dict[tuple, dict[str, Any]] = {}
    positions: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        for width in widths:
            key = (width, period_start(r["finish_time"], width), r["instance_id"], r["prompt_class"],
                   r["num_speculative_tokens"])  # fmt: skip
            t = totals.get(key)
            if t is None:
                t = totals[key] = dict(zip(KEY, key, strict=True), requests=0, drafting_requests=0, errors=0,
                                       ttft_s_sum=0.0, e2e_s_sum=0.0, **dict.fromkeys(SUMMED, 0))  # fmt: skip
            t["requests"] += 1
            t["drafting_requests"] += r["num_draft_tokens"] > 0
            t["errors"] += r["finish_reason"] == "error"
            for column in SUMMED:
                t[column] += r[column]
            t["ttft_s_sum"] += r["ttft_s"] or 0.0
            t["e2e_s_sum"] += r["e2e_s"]
            if not r["num_draft_tokens"]:
                continue  # per position counts the requests that drafted (zeros would only pad the lists)
            accepted = r["accepted_per_position"] or []
            for i, drafted in enumerate(r["drafted_per_position"] or []):
                entry = positions[(*key, i)]
                entry[0] += drafted
                entry[1] += accepted[i] if i < len(accepted) else 0
    position_rows = [dict(zip((*KEY, "position"), k, strict=True), drafted=d, accepted=a)
                     for k, (d, a) in positions.items()]  # fmt: skip
    return list(totals.values()), position_rows


def add_sums(conn: Connection, totals: Sequence[dict], positions: Sequence[dict]) -> None:
    """Add sums to their rows (created where missing), inside the caller's transaction.

    Rows go in key order, so two writers that touch the same rows lock them in the same order."""
    for model, rows in ((RequestSum, totals), (RequestSumPosition, positions)):
        if not rows:
            continue
        table = model.__table__
        keys = [c.name for c in table.primary_key.columns]
        stmt = conflict_insert(conn, table)
        added = {c.name: table.c[c.name] + stmt.excluded[c.name] for c in table.columns if c.name not in keys}
        rows = sorted(rows, key=lambda row: tuple(row[k] for k in keys))
        conn.execute(stmt.on_conflict_do_update(index_elements=keys, set_=added), rows)


def _writer_lock_keys(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Advisory-lock keys of the batch's instances, sorted (two batches lock in the same order)."""
    digests = {hashlib.sha256(f"spectune-records:{row['instance_id']}".encode()).digest()[:8] for row in rows}
    return sorted(int.from_bytes(d, "big", signed=True) for d in digests)


def insert_new_records(conn: Connection, rows: Sequence[dict[str, Any]]) -> int:
    """Insert request_records rows, skipping ids already stored, and add the new ones to the sums,
    in the caller's transaction; returns how many were new.

    SQLite: ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` says which rows went in.  PostgreSQL:
    the same costs 6x a bulk insert, so the stored ids are read first (an index lookup) and the
    rest inserted; two transactions could store one record only if both write its instance's
    records, and they take that instance's advisory lock first, so the second sees the first's
    rows.  Either way no record is ever summed twice."""
    if not rows:
        return 0
    table = RequestRecordRow.__table__
    insert = conflict_insert(conn, table).on_conflict_do_nothing()
    if conn.dialect.name == "postgresql":
        for key in _writer_lock_keys(rows):
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
        ids = list(dict.fromkeys(row["request_id"] for row in rows))
        taken: set[str] = set()
        for lo in range(0, len(ids), 1000):
            chunk = ids[lo : lo + 1000]
            taken.update(conn.execute(select(table.c.request_id).where(table.c.request_id.in_(chunk))).scalars())
        fresh = [row for row in rows if row["request_id"] not in taken]
        if fresh:
            conn.execute(insert, fresh)
        inserted = {row["request_id"] for row in fresh}
    else:
        inserted = set(conn.execute(insert.returning(table.c.request_id), list(rows)).scalars())
    new, seen = [], set()
    for row in rows:  # a batch may carry one id twice (a replay inside one spool read): once
        if row["request_id"] in inserted and row["request_id"] not in seen:
            seen.add(row["request_id"])
            new.append(row)
    add_sums(conn, *record_sums(new))
    return len(new)


@dataclass
class Parts:
    """A range as raw-record ranges and whole periods of the sums: ``periods`` holds
    (width_s, first start, end) -- every period of that width starting in [first, end)."""

    raw: list[tuple[datetime, datetime | None]] = field(default_factory=list)
    periods: list[tuple[int, datetime, datetime]] = field(default_factory=list)


def _ceil(t: datetime, width_s: int) -> datetime:
    start = period_start(t, width_s)
    return start if start == t else start + timedelta(seconds=width_s)


def decompose(since: datetime, until: datetime | None, now: datetime, widths: Sequence[int] = WIDTHS) -> Parts:
    """[since, until) as the fewest rows to read: the widest whole periods in the middle, narrower
    ones towards the edges, raw records for what no whole minute covers.  Periods go up to the
    minute ``now`` is in (``until`` None: raw records from there on, newer ones included)."""
    parts = Parts()
    hi = min(until, now) if until is not None else now
    lo, hi = _ceil(since, widths[0]), period_start(hi, widths[0])
    if hi <= lo:
        parts.raw.append((since, until))
        return parts
    if since < lo:
        parts.raw.append((since, lo))
    if until is None or hi < until:
        parts.raw.append((hi, until))
    for narrow, wide in zip(widths, [*widths[1:], None], strict=True):
        inner_lo, inner_hi = (_ceil(lo, wide), period_start(hi, wide)) if wide else (hi, hi)
        if inner_hi <= inner_lo:  # no whole wider period inside: this width covers it all
            parts.periods.append((narrow, lo, hi))
            break
        for a, b in ((lo, inner_lo), (inner_hi, hi)):
            if a < b:
                parts.periods.append((narrow, a, b))
        lo, hi = inner_lo, inner_hi
    return parts


def in_periods(model, periods: list[tuple[int, datetime, datetime]]):
    """The rows of ``model`` (a sums table) in the given (width, first start, end) periods."""
    return or_(*(and_(model.width_s == w, model.start >= a, model.start < b) for w, a, b in periods))


def request_totals(
    db: Engine, since: datetime, until: datetime | None, prompt_class: str | None = None
) -> dict[str, tuple[int, int]]:
    """{class: (requests, output tokens)} finished in [since, until): whole periods from the sums,
    the partial minutes at the edges from the records."""
    parts = decompose(since, until, datetime.now(UTC))
    out: dict[str, list[int]] = {}
    R, S = RequestRecordRow, RequestSum
    queries = []
    for lo, hi in parts.raw:
        query = select(R.prompt_class, func.count(), func.sum(R.output_tokens)).where(R.finish_time >= lo)
        queries.append(query if hi is None else query.where(R.finish_time < hi))
    if parts.periods:
        queries.append(select(S.prompt_class, func.sum(S.requests), func.sum(S.output_tokens))
                       .where(in_periods(S, parts.periods)))  # fmt: skip
    with db.connect() as conn:
        for query in queries:
            if prompt_class is not None:
                query = query.where(query.selected_columns[0] == prompt_class)
            for cls, n, tokens in conn.execute(query.group_by(query.selected_columns[0])):
                entry = out.setdefault(cls, [0, 0])
                entry[0] += int(n or 0)
                entry[1] += int(tokens or 0)
    return {cls: (n, tokens) for cls, (n, tokens) in out.items() if n}
