"""`spectune dashboard` stopped with SIGTERM leaves nothing behind (no orphaned Streamlit server)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import free_port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes_naming(port: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"streamlit" in b" ".join(cmdline) and str(port).encode() in cmdline:
                found.append(int(proc.name))
    return found


def test_sigterm_stops_the_dashboard_and_its_server(tmp_path):
    port = free_port()
    log = tmp_path / "dashboard.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spectune.cli", "dashboard", "--api-url", "http://127.0.0.1:9", "--port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.time() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).text == "ok":
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "dashboard did not become healthy"
        time.sleep(0.3)
    assert _processes_naming(port)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not _listening(port), "a Streamlit server still listens after SIGTERM"
    assert _processes_naming(port) == [], "processes left behind"
