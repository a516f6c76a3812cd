"""Hardening of `spectune serve` with an engine (tiny models): hostile /v1 input is a 4xx in vLLM's
error shape and the engine keeps serving (a hypothesis fuzz pass included); every response carries
X-Request-Id and its id finds its record; kill -9 under load loses no record of an answered request;
a hung PostgreSQL leaves /v1 fast while policy writes fail fast with 503."""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import OPERATOR, CompletionLoad, serve_tiny
from leftovers import await_gone, cmdline

HOSTILE = [
    {"prompt": "\ud800"},
    {"messages": [{"role": "user", "content": "\udfff"}]},
    {"prompt": "hi", "stop": ["\ud800"]},
    {"prompt": "hi", "model": "\ud800"},
    {"prompt": [100000]},
    {"prompt": [-1]},
    {"prompt": [2**70]},
    {"prompt": "hi", "seed": 2**64},
    {"prompt": "hi", "max_tokens": -3},
    {"prompt": "hi", "temperature": "hot"},
]


def _post(base: str, body: dict, path: str | None = None, **headers: str) -> httpx.Response:
    path = path or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
    content = json.dumps({"model": "target", "max_tokens": 2, **body}, ensure_ascii=True)
    return httpx.post(base + path, content=content, headers={"content-type": "application/json", **headers}, timeout=60)


def _alive(base: str) -> None:
    response = _post(base, {"prompt": "the draft", "max_tokens": 4})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("body", HOSTILE, ids=lambda b: json.dumps(b, ensure_ascii=True)[:40])
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_v1_input_is_a_4xx_in_vllms_shape(served, body, stream):
    response = _post(served.base, {**body, "stream": stream})
    if response.status_code == 200:  # vLLM reports a refused stream as an error event in a 200 stream
        assert stream and '"code": 400' in response.text, response.text
    else:
        assert 400 <= response.status_code < 500, response.text
        assert set(response.json()["error"]) >= {"message", "type", "code"}
    _alive(served.base)


def test_request_id_header_names_the_record(served):
    response = _post(served.base, {"prompt": "the draft"})
    request_id = response.headers["x-request-id"]
    assert response.json()["id"] == f"cmpl-{request_id}"
    mine = _post(served.base, {"prompt": "the draft"}, **{"X-Request-Id": "client-42.a:b"})
    assert mine.headers["x-request-id"] == "client-42.a:b" and mine.json()["id"] == "cmpl-client-42.a:b"
    for bad in ["x" * 97, "a b", "ü"]:
        refused = _post(served.base, {"prompt": "the draft"}, **{"X-Request-Id": bad.encode()})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Request-Id"
    deadline = time.time() + 30  # the record reaches the database within the spooler's interval
    while time.time() < deadline:
        found = httpx.get(f"{served.base}/api/v1/records/cmpl-client-42.a:b", headers=OPERATOR)
        if found.status_code == 200:
            break
        time.sleep(0.2)
    assert found.status_code == 200 and found.json()["output_tokens"] == 2


def test_bodies_over_the_limit_are_413_in_vllms_shape(served):
    response = _post(served.base, {"prompt": "x" * (5 << 20)})
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    _alive(served.base)


TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["\x00", "\ud800", "\udfff\ud800", "\u202e", "a" * 3000]))
NUMBER = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64]),
)
VALUE = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, TEXT), lambda v: st.lists(v, max_size=3), max_leaves=6)
FIELDS = {
    "prompt": st.one_of(TEXT, st.lists(NUMBER, max_size=4), st.lists(TEXT, max_size=3), VALUE),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "x"]), "content": st.one_of(TEXT, VALUE)}
            ),
            max_size=3,
        ),
        VALUE,
    ),
    "model": st.one_of(st.just("target"), TEXT),
    "max_tokens": st.one_of(st.integers(min_value=-2, max_value=8), VALUE),
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": NUMBER,
    "n": st.one_of(st.integers(min_value=-1, max_value=3), VALUE),
    "seed": NUMBER,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "logprobs": st.one_of(st.integers(min_value=-1, max_value=30), st.booleans(), VALUE),
    "logit_bias": st.dictionaries(TEXT, NUMBER, max_size=2),
    "stream": st.booleans(),
    "spectune_class": TEXT,
    "response_format": st.one_of(st.just({"type": "json_object"}), VALUE),
}


@st.composite
def _bodies(draw):
    chat = draw(st.booleans())
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=6))
    body = {key: draw(FIELDS[key]) for key in keys}
    body.setdefault("messages" if chat else "prompt", "the draft" if not chat else [{"role": "user", "content": "hi"}])
    body["max_tokens"] = min(body["max_tokens"], 8) if isinstance(body.get("max_tokens"), int) else 4
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], 3)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def test_fuzzed_v1_requests_never_get_a_5xx(served):
    seen: dict[int, int] = {}

    @given(request=_bodies())
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(request):
        path, body = request
        # allow_nan: the JSON that clients send in practice includes NaN/Infinity literals
        content = json.dumps(body, ensure_ascii=True, allow_nan=True)
        response = httpx.post(served.base + path, content=content, headers={"content-type": "application/json"},
                              timeout=120)  # fmt: skip
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (content[:500], response.text[:500])

    run()
    assert seen.get(200, 0) >= 10 and sum(v for k, v in seen.items() if 400 <= k < 500) >= 10, seen
    _alive(served.base)


# -- slow tier: engines of their own --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_kill_9_under_load_keeps_every_answered_record(tiny, tmp_path, request, kind):
    from sqlalchemy import select

    from spectune.store.db import make_engine
    from spectune.store.models import RequestRecordRow

    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/s.db"
    else:
        server = request.getfixturevalue("pg_server")
        server.reset()
        url = server.url
    proc, base = serve_tiny(tiny, tmp_path, "--db", url, SPECTUNE_TUNER_INTERVAL_S="86400")
    tree = psutil.Process(proc.pid).children(recursive=True)  # engine core, worker, helpers, lifeline watcher
    assert any("EngineCore" in cmdline(p) for p in tree), [cmdline(p) for p in tree]
    with CompletionLoad(base, workers=6, max_tokens=6) as load:
        deadline = time.time() + 120
        while len(load.done) < 150 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-load: responses are being written as it dies
        proc.wait()
    killed_at = time.monotonic()
    answered = set(load.done)
    assert len(answered) >= 150
    left = await_gone(tree)  # #25: nothing of its tree outlives it (checked by pid)
    assert left == [], f"outlived the killed server: {[cmdline(p) for p in left]}"
    print(f"{len(tree)} processes of the killed server's tree ended {time.monotonic() - killed_at:.1f} s after it")
    port = int(base.rsplit(":", 1)[1])  # the restart takes the same port (and, on a GPU, the same device)
    proc, base = serve_tiny(tiny, tmp_path, "--db", url, port=port, SPECTUNE_TUNER_INTERVAL_S="86400")  # replays
    try:
        db = make_engine(url)
        deadline = time.time() + 60
        while time.time() < deadline:
            with db.connect() as conn:
                stored = [r[0] for r in conn.execute(select(RequestRecordRow.request_id))]
            if answered <= set(stored):
                break
            time.sleep(0.5)
        assert answered - set(stored) == set(), f"{len(answered - set(stored))} answered requests lost their record"
        assert len(stored) == len(set(stored))
        db.dispose()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
def test_sigterm_during_a_rebuild_leaves_neither_engine_behind(tiny, tmp_path):
    """#25: a SIGTERM while a method change rebuilds the engine once left the new engine core and
    its worker running with parent 1; every process of the tree, old engine or new, must end.  (At
    this moment -- the new worker just started -- vLLM's own shutdown ends them even without
    engine/lifeline.py, as it did when the SIGTERM came as the new core appeared: the case seen in
    the issue was not reproduced; the lifeline covers it whatever the moment.)"""
    moment = "Worker"
    proc, base = serve_tiny(tiny, tmp_path, "--db", f"sqlite:///{tmp_path}/s.db", SPECTUNE_TUNER_INTERVAL_S="86400")
    server = psutil.Process(proc.pid)
    first = {p.pid for p in server.children(recursive=True) if moment in cmdline(p)}
    etag = httpx.get(f"{base}/api/v1/policy", headers=OPERATOR).headers["ETag"]
    change = threading.Thread(
        target=lambda: _swallow(httpx.patch, f"{base}/api/v1/policy", json={"global": {"method": "none"}},
                                headers={**OPERATOR, "If-Match": etag}, timeout=300),
        daemon=True,
    )  # fmt: skip
    change.start()
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 300  # only stops a hang
    while not any(moment in cmdline(p) and p.pid not in first for p in seen.values()):
        assert time.monotonic() < deadline and proc.poll() is None, f"no new {moment} started"
        seen.update((p.pid, p) for p in _children_or_none(server))
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the new engine is starting up
    while proc.poll() is None:  # everything it starts until it exits belongs to its tree
        seen.update((p.pid, p) for p in _children_or_none(server))
        assert time.monotonic() < deadline, "serve did not stop on SIGTERM"
        time.sleep(0.05)
    left = await_gone(list(seen.values()))
    assert left == [], f"outlived the stopped server: {[cmdline(p) for p in left]}"


def _swallow(call, *args, **kwargs) -> None:
    """The policy change's own answer does not matter here: the server is stopped under it."""
    try:
        call(*args, **kwargs)
    except httpx.HTTPError:
        pass


def _children_or_none(process) -> list:
    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def test_spectune_warnings_reach_the_log_once_vllms_server_is_imported():
    """A vLLM dependency (model_hosting_container_standards) sets the root logger and its handlers
    to ERROR on import: `spectune serve` lost every warning of its own, the database's included."""
    import subprocess
    import sys

    script = (
        "import logging; from spectune.cli import _log_to_stderr; _log_to_stderr(); "
        "import model_hosting_container_standards.sagemaker; "  # what vLLM's build_app imports
        "logging.getLogger('spectune.store.deadline').warning('database statement exceeded')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert "WARNING:spectune.store.deadline:database statement exceeded" in result.stderr, result.stderr[-2000:]


DB_TIMEOUT_S = 3  # the client-side deadline is one second more: 4 s


@pytest.mark.slow
def test_a_hung_postgresql_leaves_v1_serving_and_writes_fail_without_a_second_wait(tiny, tmp_path, pg_server):
    pg_server.reset()
    proc, base = serve_tiny(
        tiny,
        tmp_path,
        "--db",
        pg_server.url,
        SPECTUNE_DB_TIMEOUT_S=str(DB_TIMEOUT_S),
        SPECTUNE_TUNER_INTERVAL_S="86400",
    )
    try:
        _writes_fail_at_once_while_v1_serves(base, pg_server)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = (tmp_path / "server.log").read_text()
    assert "database not answering: new connections refused" in log and "database answers again" in log


def _writes_fail_at_once_while_v1_serves(base: str, pg_server) -> None:
    """Times are printed, not bounded: what is asserted is that /v1 serves without a failure while
    the database is hung, and that after the first failed write the later ones are refused without
    a round trip (``DatabaseNotAnswering``), however late they come."""
    latencies: list[float] = []
    failures: list[str] = []
    frozen = threading.Event()
    stop = threading.Event()

    def serve_traffic() -> None:
        body = {"model": "target", "prompt": "the draft", "max_tokens": 2}
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    response = client.post(f"{base}/v1/completions", json=body)
                    if response.status_code != 200:
                        failures.append(response.text)
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                if frozen.is_set():
                    latencies.append(time.perf_counter() - start)

    def patch() -> httpx.Response:
        return httpx.patch(f"{base}/api/v1/policy", json=body, headers={**OPERATOR, "If-Match": etag}, timeout=120)

    etag = httpx.get(f"{base}/api/v1/policy", headers=OPERATOR).headers["ETag"]
    body = {"global": {"num_speculative_tokens": 2}}
    traffic = threading.Thread(target=serve_traffic, daemon=True)
    traffic.start()
    pg_server.freeze()
    frozen.set()
    try:
        writes = []
        for _ in range(3):
            start = time.perf_counter()
            response = patch()
            writes.append((response.status_code, round(time.perf_counter() - start, 2), response.json()["detail"]))
        assert [status for status, *_ in writes] == [503] * 3, writes
        assert all("(DatabaseNotAnswering)" in detail for *_, detail in writes[1:]), writes  # no second wait
        assert httpx.get(f"{base}/healthz", timeout=60).status_code == 200
        ready = httpx.get(f"{base}/readyz", timeout=60).json()
        assert ready["ready"] and ready["database"] == "unavailable (DatabaseNotAnswering)", ready  # /v1 serves
        waited = time.monotonic()
        while len(latencies) < 20:  # /v1 goes on while the database is hung
            assert time.monotonic() - waited < 120 and not failures, failures[:3]  # a hang, or a failure
            time.sleep(0.1)
    finally:
        pg_server.thaw()
        stop.set()
        traffic.join()
    assert not failures, failures[:3]  # a /v1 that needed the database would have failed once it was refused
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"\nhung database: /v1 p99 {p99 * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms over "
          f"{len(latencies)} requests (database deadline {DB_TIMEOUT_S + 1} s); writes {writes}")  # fmt: skip
    thawed = time.monotonic()
    while (response := patch()).status_code == 503:  # refused until the probe gets through (one per deadline)
        assert time.monotonic() - thawed < 120, response.text  # a hang
        time.sleep(0.1)
    assert response.status_code == 200, response.text  # back once the database answers
    print(f"writes back {time.monotonic() - thawed:.2f} s after the thaw")


@pytest.mark.slow
async def test_engine_death_under_load_starts_one_rebuild(tiny):
    import asyncio

    import psutil

    from conftest import complete, running_engine, tiny_config

    async with running_engine(tiny_config(tiny, n=3)) as (engine, sink):
        requests = [asyncio.create_task(complete(engine, p, 200, ignore_eos=True)) for p in ("a b", "c d", "e f")]
        while engine._in_flight < 3:
            await asyncio.sleep(0.01)
        (core,) = [p for p in psutil.Process().children() if "EngineCore" in cmdline(p)]
        core.kill()  # every request in flight sees the engine die
        results = await asyncio.gather(*requests, return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results)
        while engine.rebuilding or not engine.running:
            await asyncio.sleep(0.1)
        assert engine.recoveries == 1 and engine.active_config.method == "none"
        _text, ids, _ = await complete(engine, "the model draft", 8, ignore_eos=True)
        assert len(ids) == 8
    assert len([r for r in sink.records if r.error]) == 3
