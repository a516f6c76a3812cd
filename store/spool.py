"""Append-only on-disk spool: the recorder's write-ahead log.

Every record is appended here (one JSON line) before the database sees it,
so a record survives a database outage and a ``kill -9`` of the process.
Segments are numbered files; the shipper reads them in order and deletes a
segment once every line in it is in the database.  A torn last line (the
process died mid-write) is skipped on replay.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import msgspec

SUFFIX = ".jsonl"


@dataclass
class Cursor:
    segment: int
    offset: int


class Spool:
    def __init__(self, directory: str | Path, segment_bytes: int = 16 << 20) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # sampled prompts travel through it
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        existing = self.segments()
        self._active = (existing[-1] + 1) if existing else 1
        self._file = self._open(self._active)
        self._encoder = msgspec.json.Encoder()

    # -- writer side ---------------------------------------------------------
    def _open(self, number: int):
        fd = os.open(self.directory / f"{number:08d}{SUFFIX}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return os.fdopen(fd, "ab", buffering=1 << 20)

    def _encode(self, item: dict) -> bytes:
        try:
            return self._encoder.encode(item) + b"\n"
        except UnicodeEncodeError:  # a lone surrogate (not text): written as "?" rather than losing the record
            return json.dumps(item, ensure_ascii=False).encode("utf-8", "replace") + b"\n"

    def append(self, items: list[dict]) -> None:
        """Append and hand the bytes to the OS (survives kill -9; not a power cut)."""
        if not items:
            return
        data = b"".join(self._encode(item) for item in items)
        with self._lock:
            self._file.write(data)
            self._file.flush()
            if self._file.tell() >= self.segment_bytes:
                self._rotate()

    def _rotate(self) -> None:
        self._file.close()
        self._active += 1
        self._file = self._open(self._active)

    def close(self) -> None:
        with self._lock:
            empty = self._file.tell() == 0
            self._file.close()
            if empty:
                self.path(self._active).unlink(missing_ok=True)

    # -- reader side ---------------------------------------------------------
    def segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.directory.glob(f"*{SUFFIX}") if p.stem.isdigit())

    def path(self, segment: int) -> Path:
        return self.directory / f"{segment:08d}{SUFFIX}"

    def is_active(self, segment: int) -> bool:
        return segment == self._active

    def read(self, cursor: Cursor, max_items: int) -> tuple[list[dict], Cursor]:
        """Complete lines from ``cursor`` on, at most ``max_items``."""
        items: list[dict] = []
        path = self.path(cursor.segment)
        try:
            with path.open("rb") as f:
                f.seek(cursor.offset)
                offset = cursor.offset
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # being written, or torn by a crash
                    offset += len(line)
                    try:
                        items.append(msgspec.json.decode(line))
                    except msgspec.DecodeError:
                        pass  # torn line from a crash mid-write; its record never finished
                    if len(items) >= max_items:
                        break
        except FileNotFoundError:
            return [], cursor
        return items, Cursor(cursor.segment, offset)

    def finish(self, segment: int) -> None:
        """Drop a fully shipped, closed segment."""
        if not self.is_active(segment):
            self.path(segment).unlink(missing_ok=True)

    def seal(self) -> None:
        """Close the active segment so that it can be shipped and deleted."""
        with self._lock:
            if self._file.tell() > 0:
                self._rotate()

    def pending_bytes(self) -> int:
        return sum(self.path(s).stat().st_size for s in self.segments() if self.path(s).exists())
