"""Where records leave the engine.

A sink receives every ``RequestRecord``, ``StepRecord`` and ``FidelityRecord`` on the serving
path, so ``submit*`` must return quickly and never raise into the engine: a
sink that needs I/O queues the record and does the work elsewhere.  The
database recorder implements the same protocol outside ``engine/``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Protocol, runtime_checkable

from .schema import FidelityRecord, RequestRecord, StepRecord

log = logging.getLogger(__name__)


@runtime_checkable
class RecordSink(Protocol):
    def submit(self, record: RequestRecord) -> None: ...

    def submit_step(self, step: StepRecord) -> None: ...

    def submit_fidelity(self, check: FidelityRecord) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps the most recent records in memory (tests, the debug endpoint)."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self.records: deque[RequestRecord] = deque(maxlen=maxlen)
        self.steps: deque[StepRecord] = deque(maxlen=maxlen)
        self.fidelity: deque[FidelityRecord] = deque(maxlen=maxlen)

    def submit(self, record: RequestRecord) -> None:
        self.records.append(record)

    def submit_step(self, step: StepRecord) -> None:
        self.steps.append(step)

    def submit_fidelity(self, check: FidelityRecord) -> None:
        self.fidelity.append(check)

    def close(self) -> None:
        pass

    def by_id(self, request_id: str) -> RequestRecord | None:
        return next((r for r in reversed(self.records) if r.request_id == request_id), None)


class JsonlSink:
    """Appends request records as JSON lines (the engine run on its own), owner-readable only.
    Sampled prompt text stays out: it belongs in the database's sampled-prompt table, which expires."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def submit(self, record: RequestRecord) -> None:
        fields = record.model_dump(mode="json", exclude={"prompt_text", "completion_text"})
        line = json.dumps(fields, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def submit_step(self, step: StepRecord) -> None:
        pass

    def submit_fidelity(self, check: FidelityRecord) -> None:
        pass  # request records only: fidelity checks live in the database and the metrics

    def close(self) -> None:
        with self._lock:
            self._file.close()


def fan_out(sinks: list[RecordSink], record: RequestRecord | StepRecord | FidelityRecord) -> None:
    """Deliver to every sink; one failing sink never hurts serving or the others."""
    for sink in sinks:
        try:
            if isinstance(record, RequestRecord):
                sink.submit(record)
            elif isinstance(record, StepRecord):
                sink.submit_step(record)
            else:
                sink.submit_fidelity(record)
        except Exception:
            log.exception("record sink %r failed", sink)
