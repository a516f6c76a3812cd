"""The recorder: the engine's record sink that lands records in the database.

Off the serving path and lossless:

    engine --submit--> spool (disk) --shipper--> DB

* ``submit`` appends the record to the on-disk spool at once (a write to the
  OS, no fsync: ~10 us), and the engine submits a request's record before its
  last response byte goes out, so a ``kill -9`` loses no record of a response
  a client received.  A failed write (disk full) drops the record and counts it.
* The shipper reads the spool in order and inserts in batches, one
  transaction per batch; inserts are idempotent by request id, so a replay
  (after an outage or a restart) never duplicates.  While the database is
  unreachable it retries with backoff and the spool grows; when the database
  returns it catches up in order.
* An item the database refuses (e.g. NUL in text on PostgreSQL) is found by
  splitting the failing batch, stored in ``dead_letters`` with the error, and
  counted; everything after it keeps flowing.
* Step statistics are aggregated per instance x minute x batch bucket x N
  in memory and go through the same spool: running totals of the open minute
  every ``step_snapshot_interval`` seconds (the tuner sees a probe seconds after
  it ran, not when its minute closes), the final totals when it closes; the
  newer totals replace the older in the database.
* ``close`` flushes the open minute and ships what it can.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, insert
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError, StatementError

from spectune.engine.schema import FidelityRecord, RequestRecord, StepRecord

from .db import insert_ignoring_duplicates, record_row, upsert_step_stats, utc
from .models import DeadLetter, FidelityCheck, SampledPrompt
from .spool import Cursor, Spool
from .steps import StepAggregator
from .sums import insert_new_records

log = logging.getLogger(__name__)


def refused_by_database(exc: Exception) -> bool:
    """The database (or its driver) rejected the data, as opposed to being unreachable: retrying
    the same rows can never succeed.  A bind-time failure (``StatementError`` that is not a DBAPI
    error) is the driver refusing a value, e.g. PostgreSQL text with NUL; a KeyError/TypeError/
    ValueError raised while building the rows is a malformed spool item."""
    if isinstance(exc, (DataError, IntegrityError, KeyError, TypeError, ValueError)):
        return True
    return isinstance(exc, StatementError) and not isinstance(exc, DBAPIError)


class RecorderStats:
    """Counters the metrics endpoint exports."""

    def __init__(self) -> None:
        self.submitted = 0
        self.dropped = 0
        self.dead_lettered = 0
        self.spooled = 0
        self.shipped = 0
        self.db_errors = 0
        self.db_up = True


class Recorder:
    def __init__(
        self,
        db: Engine,
        spool_dir: str | Path,
        *,
        batch_size: int = 5000,
        flush_interval: float = 0.1,
        step_snapshot_interval: float = 5.0,
        max_backoff: float = 5.0,
        prompt_retention: timedelta = timedelta(days=3),
    ) -> None:
        self.db = db
        self.spool = Spool(spool_dir)
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.step_snapshot_interval = step_snapshot_interval
        self.max_backoff = max_backoff
        self.prompt_retention = prompt_retention
        self.stats = RecorderStats()
        self.writer = uuid.uuid4().hex[:16]
        self._steps = StepAggregator()
        self._closing = threading.Event()
        self._stop_spooling = threading.Event()
        self._deadline = float("inf")
        self._spooled_all = threading.Event()
        self._spooler = threading.Thread(target=self._spool_loop, name="recorder-spooler", daemon=True)
        self._shipper = threading.Thread(target=self._ship_loop, name="recorder-shipper", daemon=True)
        self._spooler.start()
        self._shipper.start()

    # -- RecordSink ----------------------------------------------------------
    def submit(self, record: RequestRecord) -> None:
        self.stats.submitted += 1
        try:  # RequestRecord is flat: its __dict__ is the dump, ~9x cheaper than model_dump()
            self.spool.append([{"kind": "request", **record.__dict__}])
        except Exception:
            self.stats.dropped += 1
            log.exception("record %s could not be spooled; dropped", record.request_id)
        else:
            self.stats.spooled += 1

    def submit_step(self, step: StepRecord) -> None:
        self._steps.add(step)

    def submit_fidelity(self, check: FidelityRecord) -> None:
        try:
            self.spool.append([{"kind": "fidelity", **check.__dict__}])
        except Exception:
            self.stats.dropped += 1
            log.exception("fidelity check of %s could not be spooled; dropped", check.request_id)
        else:
            self.stats.spooled += 1

    def close(self, timeout: float = 10.0) -> bool:
        """Flush to the spool, then ship until caught up or ``timeout``.

        Returns True when everything reached the database; otherwise the rest
        stays in the spool for the next start.
        """
        if self._closing.is_set():
            return not self.spool.segments()
        self._deadline = time.monotonic() + timeout
        self._stop_spooling.set()
        self._spooler.join()
        self._closing.set()
        self._shipper.join(timeout + 1)
        self.spool.close()
        left = self.spool.segments()
        if left:
            log.warning("recorder closed with %d spool segment(s) unshipped; they replay on next start", len(left))
        return not left

    # -- threads ---------------------------------------------------------------
    def _spool_loop(self) -> None:
        """Step statistics go to the spool (request records are spooled in ``submit``)."""
        last_snapshot = time.monotonic()
        while True:
            stop = self._stop_spooling.wait(self.flush_interval)
            snapshot = time.monotonic() - last_snapshot >= self.step_snapshot_interval
            if snapshot:
                last_snapshot = time.monotonic()
            rows = self._steps.flush(final=stop, snapshot_open=snapshot)
            items = [{"kind": "steps", "writer": self.writer, **row} for row in rows]
            if items:
                self.spool.append(items)
                self.stats.spooled += len(items)
            if stop:
                break
        self.spool.seal()
        self._spooled_all.set()

    def _ship_loop(self) -> None:
        backoff = 0.1
        segments = self.spool.segments()
        cursor = Cursor(segments[0] if segments else 1, 0)
        while True:
            # Both observed *before* the read: a segment seen rotated (or the spooler seen done) then
            # was complete when read, so an empty read means shipped.  Looked at after the read, a line
            # appended just before a rotation would be deleted unshipped with its segment.
            spooled_all = self._spooled_all.is_set()
            later = [s for s in self.spool.segments() if s > cursor.segment]
            items, after = self.spool.read(cursor, self.batch_size)
            if items:
                dead_before = self.stats.dead_lettered
                try:
                    self._ship(items)
                except Exception as exc:
                    self.stats.db_errors += 1
                    if not isinstance(exc, (OperationalError, DBAPIError)):
                        log.exception("recorder could not write a batch; retrying from the spool")
                    elif self.stats.db_up:
                        log.warning("database unreachable, spooling: %s", exc.__class__.__name__)
                    self.stats.db_up = False
                    if self._closing.is_set() and time.monotonic() + backoff > self._deadline:
                        return  # shutting down with the DB away: the spool keeps the rest
                    time.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff)
                    continue
                if not self.stats.db_up:
                    log.info("database back, caught up from the spool")
                self.stats.db_up, backoff = True, 0.1
                self.stats.shipped += len(items) - (self.stats.dead_lettered - dead_before)
                cursor = after
                continue
            if later:  # this segment is complete: it was rotated, nothing more comes
                self.spool.finish(cursor.segment)
                cursor = Cursor(later[0], 0)
                continue
            if spooled_all:
                return
            if cursor.offset > (1 << 20):
                self.spool.seal()  # let a large shipped segment be deleted
            time.sleep(self.flush_interval / 2)

    def _ship(self, items: list[dict]) -> None:
        """Insert ``items``; those the database refuses go to ``dead_letters`` (found by halving the
        batch, so one bad row costs log2(batch) retries, not a retry per row)."""
        try:
            self._insert(items)
        except Exception as exc:
            if not refused_by_database(exc):
                raise
            if len(items) == 1:
                self._dead_letter(items[0], exc)
                if items[0].get("prompt_text") is not None:  # the record itself may still store
                    self._ship([{**items[0], "prompt_text": None, "completion_text": None}])
                return
            middle = len(items) // 2
            self._ship(items[:middle])
            self._ship(items[middle:])

    def _dead_letter(self, item: dict, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {getattr(exc, 'orig', None) or exc}"[:2000]
        log.error("the database refused a %s item (%s); kept in dead_letters", item.get("kind"), error)
        row = dict(
            at=datetime.now(UTC),
            kind=str(item.get("kind"))[:16],
            request_id=item.get("request_id"),
            error=error.replace("\x00", "\\x00"),
            payload=json.dumps(item, ensure_ascii=True, default=str),  # ASCII escapes: always storable
        )
        with self.db.begin() as conn:
            conn.execute(insert(DeadLetter), [row])
        self.stats.dead_lettered += 1

    def _insert(self, items: list[dict]) -> None:
        requests, steps, prompts, checks = [], [], [], []
        for original in items:
            item = dict(original)  # a refused batch is split and retried from the originals
            kind = item.pop("kind")
            if kind == "request":
                if item.get("prompt_text") is not None:
                    finished = utc(item["finish_time"])
                    prompts.append(
                        dict(
                            request_id=item["request_id"],
                            prompt_class=item["prompt_class"],
                            prompt=item["prompt_text"],
                            completion=item.get("completion_text"),
                            created_at=finished,
                            expires_at=finished + self.prompt_retention,
                        )
                    )
                requests.append(record_row(item))
            elif kind == "fidelity":
                item["checked_at"] = utc(item["checked_at"])
                checks.append(item)
            else:
                item["minute"] = utc(item["minute"])
                steps.append(item)
        with self.db.begin() as conn:  # one transaction: a refused prompt leaves no half-shipped batch
            insert_new_records(conn, requests)  # and their sums, exactly once
            upsert_step_stats(conn, steps)
            insert_ignoring_duplicates(conn, SampledPrompt.__table__, prompts)
            insert_ignoring_duplicates(conn, FidelityCheck.__table__, checks)
