"""The OpenAI-compatible server, end to end: `spectune serve` in a subprocess
on the tiny models, driven by the official `openai` client and raw httpx.
Errors are vLLM's (tests/test_openai_compat.py holds them against vLLM's own
server); the prompt class is spectune's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "target"


@pytest.fixture(scope="module")
def server(served):
    return served.base, served.records


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_and_stream_agree(client):
    kw = dict(model=MODEL, prompt="the model draft", max_tokens=20, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].text and full.usage.completion_tokens == 20
    assert full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_and_stream_agree(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "accept the draft"}], max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", max_tokens=-5), "max_tokens"),
        (dict(prompt="x", max_tokens=100_000), "max_tokens"),
        (dict(prompt="x", temperature=-0.5), "temperature"),
        (dict(prompt="x", top_p=0), "top_p"),
        (dict(prompt="x", top_p=1.5), "top_p"),
        (dict(prompt="x" * (2 << 20)), "input_text"),  # vLLM names it so
        (dict(prompt="x", extra_body={"spectune_class": "nope"}), "spectune_class"),
    ],
)
def test_bad_input_is_a_400_in_openai_format(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, **{"max_tokens": 4, **kwargs})
    body = info.value.body
    assert body["param"] == param and body["type"] == "BadRequestError" and body["code"] == 400 and body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["type"] == "NotFoundError" and info.value.body["param"] == "model"


def test_malformed_json_and_unknown_field_as_vllm_answers_them(server):
    base = server[0]
    r = httpx.post(
        f"{base}/v1/completions",
        content=b'{"model": "target", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    # vLLM ignores fields it does not know (and logs them), as OpenAI clients' extras expect
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "bogus": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_still_serving_and_every_request_recorded(client, server):
    before = len(_records(server[1]))
    out = client.completions.create(
        model=MODEL, prompt="still alive", max_tokens=5, extra_headers={"X-Spectune-Class": "long"}
    )
    assert out.usage.completion_tokens == 5
    list(client.completions.create(model=MODEL, prompt="a streamed one", max_tokens=3, stream=True))
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    time.sleep(0.3)
    new = _records(server[1])[before:]
    assert [r["output_tokens"] for r in new] == [5, 3, 4]
    assert [r["prompt_class"] for r in new] == ["long", "qa", "qa"]
    seen = [(r["finish_reason"], r["speculation_method"]) for r in new]
    assert seen == [("length", "draft_model")] * 3, new
    assert all(r["num_accepted_tokens"] == r["num_draft_tokens"] for r in new)  # copy draft
