"""spectune's /v1 is vLLM's OpenAI server: the same request matrix
(tests/openai_matrix.py) against `python -m vllm.entrypoints.openai.api_server`
and `spectune serve`, both on the tiny fp32 models with the same vLLM
arguments and the same draft speculation (copy draft, N=3).  Identical status
codes, response keys, error shapes and greedy texts; every served request
leaves exactly one record per prompt, under the response's id.

The reference server loads spectune's vLLM fixes too (``vllm.general_plugins``
loads in every vLLM process of this environment): without the top-k fix
(engine/vllm_fixes.py) it dies on the first top-k request with speculation.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import VIEWER, spawn_server, vllm_server, wait_ready
from openai_matrix import CASES, MODEL

COMMON = [
    "--served-model-name", MODEL,
    "--max-model-len", "512",
    "--max-num-seqs", "16",
    "--enable-auto-tool-choice",
    "--tool-call-parser", "pythonic",
]  # fmt: skip


KEY = "sk-compat"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONSTRAINED = {"tools", "response_format", "structured_outputs"}


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    """(vLLM's server, spectune serve, a plain vLLM server): started together, ready together."""
    root = tmp_path_factory.mktemp("compat")
    ref, ref_port = vllm_server(tiny, root / "vllm.log", [*COMMON, "--api-key", KEY], speculative=True)
    plain, plain_port = vllm_server(tiny, root / "plain.log", COMMON, speculative=False)
    env = dict(
        os.environ,
        SPECTUNE_KV_CACHE_SPACE_GIB="1",
        SPECTUNE_SPOOL_DIR=str(root / "spool"),
        SPECTUNE_API_TOKENS=json.dumps({"vic": {"token": "viewer-token", "role": "viewer"}}),
        SPECTUNE_TUNER_INTERVAL_S="86400",
        SPECTUNE_OPENAI_API_KEY=KEY,  # vLLM's own --api-key on the other side
    )
    spectune_args = ["--model", str(tiny["target"]), "--draft-model", str(tiny["copy"]), "-n", "3"]
    spectune_args += ["--max-speculative-tokens", "3", "--dtype", "float32", "--db", f"sqlite:///{root}/db.sqlite"]
    try:
        proc, base = spawn_server([*spectune_args, *COMMON], env, root / "spectune.log", timeout=300)
        try:
            wait_ready(ref, f"http://127.0.0.1:{ref_port}/v1/models", root / "vllm.log", headers=AUTH)
            wait_ready(plain, f"http://127.0.0.1:{plain_port}/v1/models", root / "plain.log")
            yield f"http://127.0.0.1:{ref_port}", base, f"http://127.0.0.1:{plain_port}"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    finally:
        for p in (ref, plain):
            p.terminate()
            p.wait(timeout=60)


def _keys(value, prefix: str = "") -> set[str]:
    """Every key path of a JSON value (list elements merged)."""
    if isinstance(value, dict):
        out = set()
        for k, v in value.items():
            out |= {f"{prefix}.{k}"} | _keys(v, f"{prefix}.{k}")
        return out
    if isinstance(value, list):
        return set().union(*(_keys(v, prefix + "[]") for v in value)) if value else set()
    return set()


def _call(client: httpx.Client, base: str, path: str, body: dict) -> dict:
    """Status, parsed body (streams: their events) and the text a greedy request produced."""
    if not body.get("stream"):
        r = client.post(base + path, json=body)
        data = r.json()
        return {"status": r.status_code, "events": [data], "text": _texts(data)}
    with client.stream("POST", base + path, json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        if r.status_code != 200:
            return {"status": r.status_code, "events": [json.loads(r.read() or "{}")], "text": None}
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    return {"status": 200, "events": events, "text": _texts(*events)}


def _texts(*events: dict) -> dict[int, str]:
    out: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices") or []:
            part = choice.get("text")
            if part is None:
                delta = choice.get("message") or choice.get("delta") or {}
                calls = [{k: v for k, v in c.items() if k != "id"} for c in delta.get("tool_calls") or []]
                part = (delta.get("content") or "") + json.dumps(calls)  # tool call ids are random
            out[choice["index"]] = out.get(choice["index"], "") + part
    return out


def _record(base: str, request_id: str, timeout: float = 60) -> dict:
    """The record of a response, once the recorder has written it."""
    deadline = time.time() + timeout
    while True:
        r = httpx.get(f"{base}/api/v1/records/{request_id}", headers=VIEWER, timeout=10)
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 404, r.text
        assert time.time() < deadline, f"no record {request_id}"
        time.sleep(0.2)


def _record_ids(event: dict, prompts: int) -> list[str]:
    return [event["id"]] if prompts == 1 else [f"{event['id']}-{i}" for i in range(prompts)]


def test_same_answers_as_vllm_and_one_record_per_prompt(servers):
    ref, ours, _ = servers
    mismatches, served = [], []
    with httpx.Client(timeout=120, headers=AUTH) as client:
        for name, path, body, prompts in CASES:
            a, b = _call(client, ref, path, body), _call(client, ours, path, body)
            if a["status"] != b["status"]:
                mismatches.append(f"{name}: status {a['status']} vs {b['status']}: {b['events'][0]}")
                continue
            ka = set().union(*map(_keys, a["events"]))
            kb = set().union(*map(_keys, b["events"]))
            if body.get("stop"):  # vLLM loses the metrics of requests stopped by a string; spectune keeps them
                ka, kb = ({k for k in keys if not k.startswith(".metrics")} for keys in (ka, kb))
            if ka != kb:
                mismatches.append(f"{name}: keys only vLLM {sorted(ka - kb)}, only spectune {sorted(kb - ka)}")
            if a["status"] != 200:
                ea, eb = a["events"][0]["error"], b["events"][0]["error"]
                if (ea["type"], ea["param"], ea["code"]) != (eb["type"], eb["param"], eb["code"]):
                    mismatches.append(f"{name}: error {ea} vs {eb}")
            elif body.get("temperature") == 0 and a["text"] != b["text"]:
                mismatches.append(f"{name}: greedy text {a['text']} vs {b['text']}")
            if b["status"] == 200:
                served.append((name, body, b["events"], prompts))
    assert not mismatches, "\n".join(mismatches)
    assert len(served) >= 30
    total = 0
    for name, body, events, prompts in served:
        usage = next((e["usage"] for e in events if e.get("usage")), None)
        records = [_record(ours, rid) for rid in _record_ids(events[0], prompts)]
        total += len(records)
        assert all(r["finish_reason"] in ("stop", "length") for r in records), name
        assert all(r["speculation_method"] == "draft_model" for r in records), name
        if not CONSTRAINED & body.keys():  # vLLM drops drafts the grammar rejects (the tiny draft's all)
            assert all(r["num_draft_tokens"] > 0 for r in records if r["output_tokens"] > 2), (name, records)
        if usage is not None:  # choices and prompts summed
            assert sum(r["output_tokens"] for r in records) == usage["completion_tokens"], (name, records, events)
    listed = httpx.get(f"{ours}/api/v1/records", headers=VIEWER, params={"limit": 1000}).json()["items"]
    assert len(listed) == total  # rejected requests left none


def test_official_client_usage_chunk_and_class_sources(servers):
    ours = servers[1]
    client = openai.OpenAI(base_url=f"{ours}/v1", api_key=KEY, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert _record(ours, chunks[0].id)["output_tokens"] == 6
    sources = [
        ({"extra_headers": {"X-Spectune-Class": "long"}}, "long"),
        ({"extra_body": {"spectune_class": "long"}}, "long"),
        ({"extra_body": {"vllm_xargs": {"spectune_class": "long"}}}, "long"),
        ({"extra_body": {"spectune_class": "qa"}, "extra_headers": {"X-Spectune-Class": "long"}}, "qa"),  # body wins
        ({}, "qa"),  # classifier: a short prompt
    ]
    for kw, expected in sources:
        out = client.completions.create(model=MODEL, prompt="a short one", max_tokens=3, temperature=0, **kw)
        assert _record(ours, out.id)["prompt_class"] == expected, kw
    for kw in ({"extra_body": {"spectune_class": "nope"}}, {"extra_headers": {"X-Spectune-Class": "nope"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=3, **kw)
        assert info.value.body["param"] == "spectune_class" and "known: long, qa" in info.value.body["message"]


def test_logprobs_with_speculation_match_a_plain_engine(servers):
    _, ours, plain = servers
    body = {"model": MODEL, "prompt": "the model draft target", "max_tokens": 16, "temperature": 0, "logprobs": 3}
    spec = httpx.post(f"{ours}/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]["logprobs"]
    base = httpx.post(f"{plain}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert spec["tokens"] == base["tokens"]
    assert spec["token_logprobs"] == pytest.approx(base["token_logprobs"], abs=1e-4)
    for a, b in zip(spec["top_logprobs"], base["top_logprobs"], strict=True):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


def test_sampling_fields_concurrently_never_crash_the_engine(servers):
    """Each sampling field with speculation on, four at a time (the top-k crash needed a batch)."""
    ours = servers[1]
    fields = [
        {"top_k": 5}, {"top_k": 1}, {"top_p": 0.5}, {"top_k": 8, "top_p": 0.9}, {"min_p": 0.2},
        {"presence_penalty": 1.0}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.5},
        {"logit_bias": {"7": 5}}, {"min_tokens": 6}, {"seed": 3}, {"n": 3}, {"best_of": 3},
        {"bad_words": ["the"]}, {"allowed_token_ids": [9, 10, 11]}, {"logprobs": 4}, {"prompt_logprobs": 2},
        {"stop": ["e"]}, {"stop_token_ids": [9]}, {"ignore_eos": True}, {"temperature": 1.5},
        {"structured_outputs": {"regex": "[ab]+"}}, {"truncate_prompt_tokens": 2},
    ]  # fmt: skip
    bodies = [
        {"model": MODEL, "prompt": "a draft of the model", "max_tokens": 10, "temperature": 0.9, **f} for f in fields
    ]
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda b: httpx.post(f"{ours}/v1/completions", json=b, headers=AUTH, timeout=120), bodies * 2)
        )
    by_field = {json.dumps(f): r.status_code for f, r in zip(fields * 2, answers, strict=True)}
    refused = {f for f, status in by_field.items() if status != 200}
    assert refused == {'{"min_p": 0.2}', '{"logit_bias": {"7": 5}}'}, by_field  # vLLM: not with speculation
    assert all("speculative decoding" in r.json()["error"]["message"] for r in answers if r.status_code == 400)
    alive = httpx.post(f"{ours}/v1/completions", json=bodies[0], headers=AUTH, timeout=60)
    assert alive.status_code == 200 and httpx.get(f"{ours}/readyz").json()["ready"]


def test_stream_cut_by_the_client_is_recorded_as_aborted(servers):
    import subprocess
    import sys

    ours = servers[1]
    body = {"model": MODEL, "prompt": "the draft", "max_tokens": 500, "ignore_eos": True, "stream": True}
    # The cut must reach the server before the engine has written the whole stream: the request runs as
    # long as the model allows, and eight streams beside it slow every step.  They run in another
    # process: reader threads in this one could hold the GIL while the cutting client waits for it.
    # It says "streaming" once all eight have had tokens: cuts made before that (its interpreter still
    # starting on a loaded host) met an idle engine that wrote 500 tokens in 0.8 s (ci-local, 3 of 3).
    beside = (
        "import asyncio, httpx, json, sys\n"
        "streaming = set()\n"
        "async def one(client, k):\n"
        f"    async with client.stream('POST', '{ours}/v1/completions', json={body!r}) as r:\n"
        "        async for line in r.aiter_lines():\n"
        "            if len(streaming) < 8 and line.startswith('data: '):\n"
        "                streaming.add(k)\n"
        "                if len(streaming) == 8: print('streaming', flush=True)\n"
        "async def main():\n"
        f"    async with httpx.AsyncClient(timeout=300, headers={AUTH!r}) as client:\n"
        "        while True: await asyncio.gather(*(one(client, k) for k in range(8)))\n"
        "asyncio.run(main())\n"
    )
    load = subprocess.Popen([sys.executable, "-c", beside], stdout=subprocess.PIPE, text=True)
    try:
        assert load.stdout.readline().strip() == "streaming", "the streams beside never got tokens"
        seen = []
        for _ in range(3):  # when the server notices a cut is up to its event loop: one in three must be seen
            with (
                httpx.Client(timeout=60, headers=AUTH) as client,
                client.stream("POST", f"{ours}/v1/completions", json=body) as r,
            ):
                first = next(line for line in r.iter_lines() if line.startswith("data: "))
            record = _record(ours, json.loads(first[6:])["id"])
            seen.append((record["finish_reason"], record["output_tokens"], round(record["e2e_s"] or 0, 2)))
            if record["finish_reason"] == "abort":
                assert 0 < record["output_tokens"] < 500, record
                break
            assert seen[-1][:2] == ("length", 500), record  # finished before the cut reached the engine
    finally:
        load.kill()
        load.wait()
    print(f"\ncuts (finish reason, output tokens, e2e s): {seen}")
    assert seen[-1][0] == "abort", seen


def test_malformed_json_is_vllms_400(servers):
    ref, ours, _ = servers
    cut = b'{"model": "tiny", "prompt": '
    answers = [
        httpx.post(f"{b}/v1/completions", content=cut, headers={"content-type": "application/json", **AUTH})
        for b in (ref, ours)
    ]
    assert answers[0].status_code == answers[1].status_code >= 400
    assert answers[0].json().keys() == answers[1].json().keys()


def test_api_key_is_vllms_on_v1_only(servers):
    ref, ours, _ = servers
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):  # a bare key is no bearer
        a, b = (httpx.post(f"{base}/v1/completions", json=body, headers=headers) for base in (ref, ours))
        assert a.status_code == b.status_code == 401 and a.json() == b.json()
    lower = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive (RFC 9110)
    assert httpx.post(f"{ours}/v1/completions", json=body, headers=lower).status_code == 200
    assert httpx.get(f"{ours}/readyz").status_code == 200  # spectune's routes keep their own auth
    assert httpx.get(f"{ours}/api/v1/records", headers=VIEWER).status_code == 200
