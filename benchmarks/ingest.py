"""Recorder throughput, and what the recorder costs the engine.

    python benchmarks/ingest.py [--records 100000] [--out benchmarks/results/ingest.md]

1. records/s through the recorder (submit -> spool -> database, until all rows
   are in) into SQLite and into a throwaway PostgreSQL (Debian's server,
   started here as in the tests);
2. engine tokens/s on the tiny models with the recorder + metrics sinks on vs
   no sinks: one engine, the sinks switched on and off round by round (the
   order flipping every round), medians;
3. the same over HTTP: `spectune serve` (vLLM's OpenAI server on spectune's
   engine client, records into SQLite) against vLLM's own
   `python -m vllm.entrypoints.openai.api_server`, same tiny models, same
   vLLM arguments and draft speculation, both up together, the arms taking
   turns round by round, medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from spectune.store.db import make_engine, upgrade
from spectune.store.models import RequestRecordRow
from spectune.store.recorder import Recorder

from pgserver import PgServer, available
from records import make_records


def ingest_rate(url: str, n: int, spool: Path) -> float:
    upgrade(url)
    db = make_engine(url)
    records = make_records(n, prefix=f"b{time.time_ns()}")
    recorder = Recorder(db, spool)
    start = time.perf_counter()
    for r in records:
        recorder.submit(r)
    recorder.close(timeout=600)
    elapsed = time.perf_counter() - start
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(RequestRecordRow)).scalar() >= n
    db.dispose()
    return n / elapsed


async def engine_rates(tiny: dict, rounds: int, root: Path) -> tuple[float, float]:
    """(no sinks, recorder + metrics) tokens/s on one engine, the sinks switched round by round."""
    from spectune.engine.core import SpecEngine
    from spectune.serve import request_metrics

    from conftest import complete, tiny_config

    url = f"sqlite:///{root}/engine.db"
    upgrade(url)
    recorder = Recorder(make_engine(url), root / "spool-engine")
    engine = SpecEngine(tiny_config(tiny, draft="copy", n=3))
    await engine.start()
    arms: dict[bool, list[float]] = {False: [], True: []}
    try:
        await asyncio.gather(*[complete(engine, f"warm {i}", 8) for i in range(16)])
        for i in range(2 * rounds):
            for sinks_on in (False, True)[:: 1 if i % 2 == 0 else -1]:
                engine.sinks = [recorder, request_metrics()] if sinks_on else []
                start = time.perf_counter()
                outs = await asyncio.gather(
                    *[complete(engine, f"the model {i}", 32, temperature=0.0, ignore_eos=True) for i in range(64)]
                )
                arms[sinks_on].append(sum(len(ids) for _, ids, _ in outs) / (time.perf_counter() - start))
        return statistics.median(arms[False]), statistics.median(arms[True])
    finally:
        engine.sinks = [recorder]
        await engine.shutdown()  # closes the recorder


async def _http_round(base: str, requests: int, tokens: int) -> float:
    import httpx

    body = {"model": "tiny", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *[client.post(f"{base}/v1/completions", json={**body, "prompt": f"the model {i}"}) for i in range(requests)]
        )
        elapsed = time.perf_counter() - start
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200][:1]
    return sum(a.json()["usage"]["completion_tokens"] for a in answers) / elapsed


async def http_rates(tiny: dict, rounds: int, root: Path) -> tuple[float, float]:
    """(vLLM's server, spectune serve) tokens/s: medians over alternating rounds."""
    import os

    from conftest import spawn_server, vllm_server, wait_ready

    common = ["--served-model-name", "tiny", "--max-model-len", "512", "--max-num-seqs", "16"]
    ref, port = vllm_server(tiny, root / "vllm.log", common, speculative=True)
    env = dict(os.environ, SPECTUNE_KV_CACHE_SPACE_GIB="1", SPECTUNE_SPOOL_DIR=str(root / "spool-http"))
    env["SPECTUNE_TUNER_INTERVAL_S"] = "86400"  # N stays 3, as on vLLM's side
    args = ["--model", str(tiny["target"]), "--draft-model", str(tiny["copy"]), "-n", "3"]
    args += ["--max-speculative-tokens", "3", "--dtype", "float32", "--db", f"sqlite:///{root}/http.db", *common]
    proc, ours = spawn_server(args, env, root / "spectune.log", timeout=600)
    try:
        theirs = f"http://127.0.0.1:{port}"
        wait_ready(ref, f"{theirs}/v1/models", root / "vllm.log", timeout=600)
        arms: dict[str, list[float]] = {theirs: [], ours: []}
        for base in arms:
            await _http_round(base, 16, 8)  # warm-up
        for i in range(2 * rounds):
            for base in list(arms)[:: 1 if i % 2 == 0 else -1]:
                arms[base].append(await _http_round(base, 64, 32))
        return statistics.median(arms[theirs]), statistics.median(arms[ours])
    finally:
        for p in (proc, ref):
            p.terminate()
            p.wait(timeout=60)


async def main(n: int, rounds: int, out: Path | None) -> None:
    console = Console()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sqlite_rate = ingest_rate(f"sqlite:///{root}/ingest.db", n, root / "spool-sqlite")
        console.print(f"SQLite: {sqlite_rate:,.0f} records/s")
        lines.append(f"| SQLite (file, WAL) | {sqlite_rate:,.0f} |")
        if available():
            server = PgServer().init()
            try:
                pg_rate = ingest_rate(server.url, n, root / "spool-pg")
            finally:
                server.destroy()
            console.print(f"PostgreSQL: {pg_rate:,.0f} records/s")
            lines.append(f"| PostgreSQL 15 (loopback) | {pg_rate:,.0f} |")
        from spectune.engine.models.tiny import make_family

        tiny = make_family(Path(__file__).resolve().parent.parent / "var" / "test-models")
        r_off, r_on = await engine_rates(tiny, rounds, root)
        overhead = (r_off - r_on) / r_off * 100
        console.print(f"engine tokens/s: recorder off {r_off:.0f}, on {r_on:.0f} (overhead {overhead:+.1f} %)")
        h_vllm, h_ours = await http_rates(tiny, rounds, root)
        h_overhead = (h_vllm - h_ours) / h_vllm * 100
        console.print(f"HTTP tokens/s: vLLM's server {h_vllm:.0f}, spectune serve {h_ours:.0f} ({h_overhead:+.1f} %)")
    text = "\n".join(
        [
            f"Recorder ingest, {n:,} records (submit -> spool -> database, until every row is in):",
            "",
            "| store | records/s |",
            "|---|---|",
            *lines,
            "",
            f"Engine throughput on the tiny models (copy draft, N=3, 64 concurrent requests x 32 tokens, "
            f"one engine, sinks switched round by round, median of {2 * rounds} rounds per arm): "
            f"recorder+metrics off {r_off:.0f} tokens/s, on {r_on:.0f} tokens/s, "
            f"overhead {overhead:+.1f} %.",
            "",
            f"Over HTTP, same load (median of {2 * rounds} rounds per arm, arms alternating): vLLM's own "
            f"OpenAI server {h_vllm:.0f} tokens/s, `spectune serve` (vLLM's server on spectune's engine "
            f"client, every request recorded) {h_ours:.0f} tokens/s, overhead {h_overhead:+.1f} %.",
        ]
    )
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=10, help="rounds per arm and order (2x this per arm)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ingest.md"))
    args = parser.parse_args()
    asyncio.run(main(args.records, args.rounds, args.out))
