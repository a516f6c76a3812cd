"""Shared fixtures: the tiny model family and engine helpers.

Engines take ~15 s to start on this CPU, so tests start one per module (or
per configuration) and share it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from spectune.engine import EngineConfig, MemorySink, RuntimeSettings
from spectune.engine.lifeline import MARK_ENV

import leftovers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# vLLM processes started under the tests end with their parent (engine/lifeline.py's plugin), as
# they do under `spectune serve`: an in-process engine's core ends with a killed pytest.
os.environ.setdefault(MARK_ENV, "pytest")


def pytest_configure(config: pytest.Config) -> None:
    leftovers.become_subreaper()
    signal.signal(signal.SIGTERM, _stop_the_run)
    # vLLM's IPC sockets of the engines the tests run in-process (or as `vllm serve`) go to one
    # directory, removed at the end; `spectune serve` under the tests makes its own.
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="spectune-test-ipc-")


def _stop_the_run(signum, frame) -> None:
    """A stopped test run (SIGTERM) ends as an interrupted one: fixtures tear down their servers
    and the end-of-run check ends whatever they started."""
    raise KeyboardInterrupt


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a process the tests started is still alive at the end (#25); a stopped run
    waits less for them."""
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
    left = leftovers.leftovers(deadline_s=15 if interrupted else 120)
    shutil.rmtree(os.environ["VLLM_RPC_BASE_PATH"], ignore_errors=True)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"{len(left)} process(es) started by the tests outlived them (now ended): " + "; ".join(left)
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        if not interrupted:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


MODEL_CACHE = Path(os.environ.get("SPECTUNE_TEST_MODELS", Path(__file__).parent.parent / "var" / "test-models"))


@pytest.fixture(scope="session")
def tiny() -> dict[str, Path]:
    from spectune.engine.models.tiny import make_family

    return make_family(MODEL_CACHE)


def tiny_config(
    tiny: dict[str, Path], method: str = "draft_model", draft: str = "copy", n: int = 4, **kw
) -> EngineConfig:
    return EngineConfig(
        model=str(tiny["target"]),
        method=method,
        draft_model=str(tiny[draft]) if method == "draft_model" else None,
        max_speculative_tokens=max(n, 1),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        kv_cache_space_gib=1,
        instance_id="test",
        initial=RuntimeSettings(num_speculative_tokens=n, speculation_enabled=n > 0),
        **kw,
    )


@asynccontextmanager
async def running_engine(config: EngineConfig):
    from spectune.engine.core import SpecEngine

    sink = MemorySink()
    engine = SpecEngine(config, [sink])
    await engine.start()
    try:
        yield engine, sink
    finally:
        await engine.shutdown()


class PlainEngine:
    """The session's one plain (``--method none``) tiny engine, on an event loop thread of its own,
    so that every module compares against a true plain engine without starting one (each start
    and stop costs ~35 s here).  ``call(fn)`` runs ``fn(engine, sink)`` there from any loop."""

    def __init__(self, config: EngineConfig) -> None:
        import asyncio
        import threading

        from spectune.engine.core import SpecEngine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="plain-engine", daemon=True)
        self.thread.start()
        self.sink = MemorySink()
        self.engine = SpecEngine(config, [self.sink])
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result(timeout=600)

    async def call(self, fn):
        import asyncio

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(self.engine, self.sink), self.loop))

    async def complete(self, prompt: str, max_tokens: int = 24, **kw) -> tuple[str, list[int], str]:
        return await self.call(lambda engine, _: complete(engine, prompt, max_tokens, **kw))

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.engine.shutdown(), self.loop).result(timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="session")
def plain_engine(tiny):
    engine = PlainEngine(tiny_config(tiny, method="none", n=0))
    yield engine
    engine.close()


@asynccontextmanager
async def control_plane_on_loopback(db_url: str, token: str = "op"):
    """A control plane (no engine) served by uvicorn in a thread on a free port; yields its base URL."""
    import asyncio
    import threading

    import uvicorn

    from spectune.api.auth import Role, TokenSpec
    from spectune.app import create_app
    from spectune.store.db import make_engine, upgrade

    upgrade(db_url)
    app = create_app(None, make_engine(db_url), {"op": TokenSpec(token=token, role=Role.OPERATOR)})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


async def complete(engine, prompt: str, max_tokens: int = 24, **kw) -> tuple[str, list[int], str]:
    """Run one request to the end; returns (text, token ids, request id)."""
    import uuid

    from spectune.engine.core import GenerationRequest

    rid = kw.pop("request_id", None) or f"t-{uuid.uuid4().hex[:12]}"
    text, ids = [], []
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, request_id=rid, **kw)
    async for delta in engine.generate(req):
        text.append(delta.text)
        ids.extend(delta.token_ids)
    return "".join(text), ids, rid


PROMPTS = [
    f"{a} {b} {c}"
    for a, b, c in zip(
        "the model draft target batch policy engine record cache value error step rate list code answer "
        "question summary import token accept".split(),
        "verify decode accept reject class tuner latency print return def while for if else result".split() * 2,
        "of to and in is it for on with as by at from that this be are was not the".split(),
    )
]
assert len(PROMPTS) >= 20


@pytest.fixture(scope="session")
def pg_server():
    """A throwaway PostgreSQL; skipped only where the binaries are missing
    and SPECTUNE_REQUIRE_PG is unset (CI sets it, so CI never skips)."""
    import pgserver

    if not pgserver.available():
        if os.environ.get("SPECTUNE_REQUIRE_PG"):
            pytest.fail("PostgreSQL binaries not found but SPECTUNE_REQUIRE_PG is set")
        pytest.skip("PostgreSQL not installed (apt-get install postgresql)")
    server = pgserver.PgServer().init()
    yield server
    server.destroy()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """An empty database of each supported kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/spectune.db"
    server = request.getfixturevalue("pg_server")
    server.reset()
    return server.url


API_TOKENS = {
    "vic": {"token": "viewer-token", "role": "viewer"},
    "ola": {"token": "operator-token", "role": "operator"},
}
VIEWER = {"Authorization": "Bearer viewer-token"}
OPERATOR = {"Authorization": "Bearer operator-token"}


def token_specs() -> dict:
    """API_TOKENS as the app takes them (for create_app in-process)."""
    from spectune.api.auth import TokenSpec

    return {name: TokenSpec.model_validate(spec) for name, spec in API_TOKENS.items()}


@dataclass
class Served:
    base: str
    records: Path
    db: str


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(args: list[str], env: dict[str, str], log_path: Path, timeout: float, port: int | None = None):
    """Start `spectune serve ARGS` (on ``port``, default a free one) and wait until /readyz says ready;
    returns (process, base URL). The process leads a session of its own: ``os.killpg`` takes its
    children too (vLLM's engine core), as killing a container would."""
    import subprocess
    import sys

    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "spectune.cli", "serve", "--port", str(port), *args],
        env=env,
        stdout=log_path.open("a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{base}/readyz", log_path, timeout, ready=lambda r: r.json().get("ready"))
    except TimeoutError:
        proc.kill()
        raise
    return proc, base


def vllm_server(tiny: dict[str, Path], log_path: Path, args: list[str], speculative: bool):
    """vLLM's own OpenAI server on the tiny target (copy draft, N=3 when ``speculative``);
    returns (process, port). Wait for it with ``wait_ready`` on ``/v1/models``."""
    import subprocess
    import sys

    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny["target"])]
    argv += ["--dtype", "float32", "--seed", "0", "--enforce-eager", "--port", str(port), *args]
    if speculative:
        spec = {"method": "draft_model", "model": str(tiny["copy"]), "num_speculative_tokens": 3}
        argv += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.Popen(argv, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT), port


def wait_ready(proc, url: str, log_path: Path, timeout: float = 300, headers: dict | None = None, ready=None) -> None:
    """Until GET ``url`` answers 200 (and ``ready(response)`` holds); fails with the log's tail
    if the process exits, TimeoutError after ``timeout``."""
    import time

    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
        try:
            r = httpx.get(url, headers=headers, timeout=2)
            if r.status_code == 200 and (ready is None or ready(r)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server did not become ready: {log_path.read_text()[-3000:]}")


def serve_tiny(
    tiny: dict[str, Path],
    root: Path,
    *args: str,
    timeout: float = 180,
    draft: str = "copy",
    port: int | None = None,
    **env_overrides: str,
):
    """`spectune serve` on the tiny models (``draft``: copy / indep / noised; N=3 of capacity 4) with test tokens."""
    env = dict(
        os.environ,
        SPECTUNE_MAX_MODEL_LEN="512",
        SPECTUNE_KV_CACHE_SPACE_GIB="1",
        SPECTUNE_DTYPE="float32",
        SPECTUNE_SPOOL_DIR=str(root / "spool"),
        SPECTUNE_API_TOKENS=json.dumps(API_TOKENS),
        **env_overrides,
    )
    model_args = ["--model", str(tiny["target"]), "--draft-model", str(tiny[draft]), "-n", "3"]
    return spawn_server([*model_args, "--max-speculative-tokens", "4", *args], env, root / "server.log", timeout, port)


class CompletionLoad:
    """Threads posting greedy completions until the block ends; the id of every answered response
    is kept, every failure (a non-200, a connection error, a timeout) is collected.  ``pause_s``:
    each client waits that long between requests (steady traffic that leaves CPU to something else
    on 2 cores, e.g. an engine starting beside it); 0 posts back to back."""

    def __init__(self, base: str, workers: int = 4, max_tokens: int = 24, pause_s: float = 0.0) -> None:
        import threading

        self.base, self.max_tokens, self.pause_s, self.failures, self.done = base, max_tokens, pause_s, [], []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        import httpx

        body = {
            "model": "target",
            "prompt": "the draft",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                try:
                    r = client.post(f"{self.base}/v1/completions", json=body)
                except Exception as exc:  # a refused connection or a timeout fails the load too
                    self.failures.append(repr(exc))
                    continue
                if r.status_code != 200:
                    self.failures.append(r.text)
                else:
                    self.done.append(r.json()["id"])  # the whole answer arrived
                if self.pause_s:
                    self.stop.wait(self.pause_s)

    def __enter__(self) -> CompletionLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


@pytest.fixture(scope="session")
def served(tiny, tmp_path_factory):
    """`spectune serve` in a subprocess on the tiny models (copy draft, N=3 of 4)."""
    root = tmp_path_factory.mktemp("serve")
    records, db = root / "records.jsonl", f"sqlite:///{root}/spectune.db"
    # these tests set N themselves; the tuner has its own tests
    proc, base = serve_tiny(tiny, root, "--records", str(records), "--db", db, SPECTUNE_TUNER_INTERVAL_S="86400")
    yield Served(base, records, db)
    proc.terminate()
    proc.wait(timeout=60)
