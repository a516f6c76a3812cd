"""The fidelity audit on the demo pair in bf16: how often speculation's greedy output differs from a
plain replay, and at what margins.

    python -m benchmarks.fidelity [--method draft_model|ngram] [--n 3] [--max-tokens 48] [--concurrency 1]

One speculative engine (demo pair, bf16) serves every prompt of the benchmark set once, greedy, with
the audit on for every request (``audit_fraction`` 1); each is replayed as a plain request and
compared (``engine/fidelity.py``).  Prints per result the count, and per divergence where it was and
the target's top-2 logprob margin in both runs.  ``--concurrency`` > 1 serves that many at once (the
replays then run in batches of another shape too).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from rich.console import Console

from spectune.engine import MemorySink, RuntimeSettings
from spectune.engine.core import GenerationRequest, SpecEngine
from spectune.engine.models.prepare import demo_pair_paths
from spectune.engine.schema import NEAR_TIE_NATS

from .off_state import PROMPTS, engine_config


async def serve_all(engine: SpecEngine, sink: MemorySink, max_tokens: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> None:
        async with gate:
            req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(req):
                pass

    await asyncio.gather(*[one(p) for p in PROMPTS])
    while len(sink.fidelity) + engine.auditor.failed < len(PROMPTS):
        await asyncio.sleep(0.2)


async def main(method: str, n: int, max_tokens: int, concurrency: int, out: Path | None) -> None:
    console = Console()
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    config = engine_config(pair["target"], method, pair["draft"] if method == "draft_model" else None)
    initial = RuntimeSettings(num_speculative_tokens=n)
    config = config.model_copy(update={"max_speculative_tokens": n, "initial": initial})
    sink = MemorySink()
    engine = SpecEngine(config, [sink])
    await engine.start()
    try:
        engine.auditor.max_replays = len(PROMPTS)  # every request audited
        await engine.apply(RuntimeSettings(version=1, num_speculative_tokens=n, audit_fraction=1.0))
        await serve_all(engine, sink, max_tokens, concurrency)
    finally:
        await engine.shutdown()
    checks = list(sink.fidelity)
    results = [c.result for c in checks]
    diverged = [c for c in checks if c.result != "match"]
    lines = [
        f"Demo pair, bf16, greedy, {method} N={n}, {len(PROMPTS)} prompts x {max_tokens} tokens, "
        f"{concurrency} at a time; every request replayed plain and compared; near-tie below "
        f"{NEAR_TIE_NATS} nats in both runs.",
        "",
        f"Audited {len(checks)} (replays failed: {engine.auditor.failed}): match {results.count('match')}, "
        f"near-tie {results.count('near_tie')}, defect {results.count('defect')}; "
        f"divergence rate {len(diverged) / max(1, len(checks)):.1%}.",
        "",
        "| request | result | first difference at token | margin served (nats) | margin plain (nats) |",
        "|---|---|---|---|---|",
        *[
            f"| {c.request_id} | {c.result} | {c.diverged_at} | {_nats(c.served_margin)} | {_nats(c.plain_margin)} |"
            for c in diverged
        ],
    ]
    margins = [m for c in diverged for m in (c.served_margin, c.plain_margin) if m is not None]
    if margins:
        lines += ["", f"Margins at the divergences: max {max(margins):.3f}, median {statistics.median(margins):.3f}."]
    console.print("\n".join(lines))
    if out:
        out.write_text("\n".join(lines) + "\n")


def _nats(margin: float | None) -> str:
    return "-" if margin is None else f"{margin:.3f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("draft_model", "ngram"), default="draft_model")
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(f"benchmarks/results/fidelity_{args.method}.md")
    asyncio.run(main(args.method, args.n, args.max_tokens, args.concurrency, out))
