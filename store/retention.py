"""Retention: delete request records past their age, and their sums past theirs.

The sums (``store.sums``) already hold every record: deleting a record loses only its
own row and its percentile contribution, never a count.  Deletes go in short
chunks, one transaction each, oldest first, so ingest never waits on a long lock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, delete, select

from .db import conflict_insert
from .models import RequestRecordRow, RequestSum, RequestSumPosition, RetentionHorizon, SampledPrompt
from .sums import WIDTHS


def expire_prompts(db: Engine, now: datetime | None = None) -> int:
    """Delete sampled prompts past their expiry; returns how many."""
    with db.begin() as conn:
        return conn.execute(delete(SampledPrompt).where(SampledPrompt.expires_at < (now or datetime.now(UTC)))).rowcount


def expire_records(db: Engine, older_than: timedelta, now: datetime | None = None, chunk: int = 5000) -> int:
    """Delete records finished before ``now - older_than``, ``chunk`` per transaction; returns how many."""
    cutoff = (now or datetime.now(UTC)) - older_than
    oldest = (
        select(RequestRecordRow.request_id)
        .where(RequestRecordRow.finish_time < cutoff)
        .order_by(RequestRecordRow.finish_time)
        .limit(chunk)
    )
    with db.begin() as conn:  # first: a read during the deletes already knows raw rows may be gone
        stmt = conflict_insert(conn, RetentionHorizon).values(table_name="request_records", deleted_before=cutoff)
        later = stmt.excluded.deleted_before > RetentionHorizon.deleted_before
        conn.execute(stmt.on_conflict_do_update(index_elements=["table_name"], set_={"deleted_before": cutoff},
                                                where=later))  # fmt: skip
    total = 0
    while True:
        with db.begin() as conn:
            ids = conn.execute(oldest).scalars().all()
            if not ids:
                return total
            conn.execute(delete(RequestRecordRow).where(RequestRecordRow.request_id.in_(ids)))
        total += len(ids)


def records_deleted_before(db: Engine) -> datetime | None:
    """Records finished before this may have been deleted (None: retention never ran)."""
    with db.connect() as conn:
        return conn.execute(
            select(RetentionHorizon.deleted_before).where(RetentionHorizon.table_name == "request_records")
        ).scalar()


def expire_sums(db: Engine, older_than: timedelta, now: datetime | None = None) -> int:
    """Delete the sums of periods that ended before ``now - older_than``; returns how many rows."""
    cutoff = (now or datetime.now(UTC)) - older_than
    deleted = 0
    with db.begin() as conn:
        for width in WIDTHS:
            ended = cutoff - timedelta(seconds=width)  # a period starting before this ended before the cutoff
            for model in (RequestSumPosition, RequestSum):
                done = conn.execute(delete(model).where(model.width_s == width, model.start < ended)).rowcount
            deleted += done  # the sums' rows (positions' rows go with them)
    return deleted


def run_retention(db: Engine, records: timedelta, sums: timedelta, now: datetime | None = None) -> int:
    """The scheduled job: records first, then sums; returns how many records went."""
    deleted = expire_records(db, records, now)
    expire_sums(db, sums, now)
    return deleted


def left_out(db: Engine, since: datetime, *, raw_only: bool = False) -> str | None:
    """What a read from ``since`` cannot count because retention deleted records, said in words (None:
    nothing).  Sums-backed reads miss only the records of a partial first minute; ``raw_only`` reads
    (latency percentiles) miss every record before the horizon."""
    horizon = records_deleted_before(db)
    if horizon is None or since >= horizon:
        return None
    if raw_only:
        return f"records finished before {horizon.isoformat()} were deleted by retention: not counted"
    if since.second == 0 and since.microsecond == 0:
        return None
    return (f"records finished before {horizon.isoformat()} were deleted by retention: those of the partial "
            f"first minute from {since.isoformat()} are not counted (whole minutes come from their sums)")  # fmt: skip
