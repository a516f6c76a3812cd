"""`spectune dashboard` stopped with SIGTERM or killed with -9 leaves nothing behind: no process of its
tree (checked by pid) and nothing listening on its port (#25)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from conftest import free_port
from leftovers import await_gone


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "kill -9"])
def test_a_stopped_dashboard_leaves_no_process_and_no_listener(tmp_path, stop):
    port = free_port()
    log = tmp_path / "dashboard.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spectune.cli", "dashboard", "--api-url", "http://127.0.0.1:9", "--port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.time() + 120  # only stops a hang
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).text == "ok":
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "dashboard did not become healthy"
        time.sleep(0.3)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(stop)
    proc.wait(timeout=120)
    left = await_gone(tree)
    assert left == [], f"processes left behind: {[p.pid for p in left]}"
    assert not _listening(port), "something still listens on the dashboard's port"
