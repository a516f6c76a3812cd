"""Processes and servers for tests: an ASGI app on 127.0.0.1 in a thread (fake Grafana, the API for
AppTest), installed binaries (Prometheus, Alertmanager), and waiting on a condition."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import uvicorn

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.5) -> T:
    """The first truthy value of ``predicate()``, polled; the test fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(poll)


def seconds_until(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.5) -> float:
    """``wait_for``, returning how long it took."""
    start = time.monotonic()
    wait_for(predicate, timeout, what, poll)
    return time.monotonic() - start


def binary(name: str) -> str:
    """An installed binary (Debian's prometheus packages); a skip where missing, a failure in CI."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("SPECTUNE_REQUIRE_PROMTOOL"):
            pytest.fail(f"{name} not found but SPECTUNE_REQUIRE_PROMTOOL is set")
        pytest.skip(f"{name} not installed (apt-get install prometheus prometheus-alertmanager)")
    return found


def start_process(args: list[str], log: Path, ready_url: str, timeout: float = 60) -> subprocess.Popen:
    """Start ``args`` (output to ``log``) and wait until ``ready_url`` answers 200."""
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(ready_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout, f"{args[0]} ready")
    return proc


class ThreadedServer:
    def __init__(self, app, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.server.started, 10, "the threaded server starting", poll=0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
