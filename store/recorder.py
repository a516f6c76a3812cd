"""The recorder: the engine's record sink that lands records in the database.

Off the serving path and lossless:

    engine --submit--> bounded queue --spooler--> spool (disk) --shipper--> DB

* ``submit`` never blocks: a full queue drops the record and counts it.
* The spooler appends every record to the on-disk spool within
  ``flush_interval`` (default 0.1 s), so a ``kill -9`` loses nothing that
  finished more than that before.
* The shipper reads the spool in order and inserts in batches; inserts are
  idempotent by request id, so a replay (after an outage or a restart)
  never duplicates.  While the database is unreachable it retries with
  backoff and the spool grows; when the database returns it catches up in
  order.
* Step statistics are aggregated per instance x minute x batch bucket x N
  in memory and go through the same spool when their minute closes.
* ``close`` flushes the queue and the open minute and ships what it can.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from spectune.engine.schema import RequestRecord, StepRecord

from .db import insert_ignoring_duplicates, record_row, utc
from .models import RequestRecordRow, SampledPrompt, StepStat
from .spool import Cursor, Spool
from .steps import StepAggregator

log = logging.getLogger(__name__)

_STOP = object()


class RecorderStats:
    """Counters the metrics endpoint exports."""

    def __init__(self) -> None:
        self.submitted = 0
        self.dropped = 0
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
        queue_size: int = 100_000,
        max_backoff: float = 5.0,
        prompt_retention: timedelta = timedelta(days=3),
    ) -> None:
        self.db = db
        self.spool = Spool(spool_dir)
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_backoff = max_backoff
        self.prompt_retention = prompt_retention
        self.stats = RecorderStats()
        self.writer = uuid.uuid4().hex[:16]
        # SimpleQueue: a C put without a Condition, on the event loop's hot path; bounded by hand.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._capacity = queue_size
        self._steps = StepAggregator()
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._spooled_all = threading.Event()
        self._spooler = threading.Thread(target=self._spool_loop, name="recorder-spooler", daemon=True)
        self._shipper = threading.Thread(target=self._ship_loop, name="recorder-shipper", daemon=True)
        self._spooler.start()
        self._shipper.start()

    # -- RecordSink ----------------------------------------------------------
    def submit(self, record: RequestRecord) -> None:
        self.stats.submitted += 1
        if self._queue.qsize() >= self._capacity:
            self.stats.dropped += 1
        else:
            self._queue.put_nowait(record)

    def submit_step(self, step: StepRecord) -> None:
        self._steps.add(step)

    def close(self, timeout: float = 10.0) -> bool:
        """Flush to the spool, then ship until caught up or ``timeout``.

        Returns True when everything reached the database; otherwise the rest
        stays in the spool for the next start.
        """
        if self._closing.is_set():
            return not self.spool.segments()
        self._deadline = time.monotonic() + timeout
        self._queue.put(_STOP)
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
        stop = False
        while not stop:
            items: list[dict] = []
            deadline = time.monotonic() + self.flush_interval
            while len(items) < self.batch_size:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                # RequestRecord is flat: its __dict__ is the dump, ~9x cheaper than model_dump().
                items.append({"kind": "request", **item.__dict__})
            closed = self._steps.flush(final=stop)
            items += [{"kind": "steps", "writer": self.writer, **row} for row in closed]
            if items:
                self.spool.append(items)
                self.stats.spooled += len(items)
        self.spool.seal()
        self._spooled_all.set()

    def _ship_loop(self) -> None:
        backoff = 0.1
        segments = self.spool.segments()
        cursor = Cursor(segments[0] if segments else 1, 0)
        while True:
            items, after = self.spool.read(cursor, self.batch_size)
            if items:
                try:
                    self._insert(items)
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
                self.stats.shipped += len(items)
                cursor = after
                continue
            later = [s for s in self.spool.segments() if s > cursor.segment]
            if later:  # this segment is complete: it was rotated, nothing more comes
                self.spool.finish(cursor.segment)
                cursor = Cursor(later[0], 0)
                continue
            if self._spooled_all.is_set():
                return
            if cursor.offset > (1 << 20):
                self.spool.seal()  # let a large shipped segment be deleted
            time.sleep(self.flush_interval / 2)

    def _insert(self, items: list[dict]) -> None:
        requests, steps, prompts = [], [], []
        for item in items:
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
            else:
                item["minute"] = utc(item["minute"])
                steps.append(item)
        insert_ignoring_duplicates(self.db, RequestRecordRow.__table__, requests)
        insert_ignoring_duplicates(self.db, StepStat.__table__, steps)
        insert_ignoring_duplicates(self.db, SampledPrompt.__table__, prompts)
