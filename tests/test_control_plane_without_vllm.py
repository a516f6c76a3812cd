"""`spectune serve --no-engine` installs and serves from a virtualenv without vLLM or torch.

Slow tier: it builds a fresh virtualenv and installs spectune there (no extras) from the
configured package index, as an operator's control-plane host would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_control_plane_runs_from_a_virtualenv_without_vllm(tmp_path):
    venv = tmp_path / "cp"
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(ROOT)], capture_output=True, text=True
    )
    assert pip.returncode == 0, pip.stderr[-4000:]
    probe = "import importlib.util as u; print(u.find_spec('vllm'), u.find_spec('torch'))"
    missing = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True)
    assert missing.stdout.split() == ["None", "None"]
    port = free_port()
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SPECTUNE_DB": f"sqlite:///{tmp_path}/cp.db",
        "SPECTUNE_API_TOKENS": json.dumps({"ola": {"token": "operator-token", "role": "operator"}}),
    }
    log = tmp_path / "cp.log"
    proc = subprocess.Popen(
        [str(venv / "bin" / "spectune"), "serve", "--no-engine", "--port", str(port)],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{base}/readyz", log, 120, ready=lambda r: r.json().get("ready"))
        headers = {"Authorization": "Bearer operator-token"}
        policy = httpx.get(f"{base}/api/v1/policy", headers=headers)
        assert policy.status_code == 200 and policy.json()["version"] >= 1
        patched = httpx.patch(
            f"{base}/api/v1/policy",
            json={"global": {"num_speculative_tokens": 2}},
            headers={**headers, "If-Match": policy.headers["ETag"]},
        )
        assert patched.status_code == 200, patched.text
        assert httpx.get(f"{base}/readyz").json()["engine"] is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (exit status -15)
    assert proc.returncode in (0, -15) and "Application shutdown complete" in log.read_text()
    assert os.path.exists(tmp_path / "cp.db")
