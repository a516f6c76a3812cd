"""Is "off" free?  Speculation at N=0 against a plain engine, side by side, arms alternating.

    python -m benchmarks.off_state [--method draft_model|ngram|suffix] [--max-tokens 32] [--passes 1] [--off-only]
                                   [--out FILE]

Two engines on the demo pair (bf16) are up at once (three do not fit in 24 GiB):
a plain engine (``--method none``) and the speculative engine of ``--method``.
At 1, 4 and 8 concurrent requests, 16 prompts of our own x ``--max-tokens``
tokens (greedy) go through every arm, the arms taking turns wave by wave (a
wave is ``concurrency`` prompts sent together: A B C ... on wave 1, then on wave 2, ...):

* plain                       -- the baseline every ratio is against
* N=0                         -- speculation switched off everywhere
* N=1, N=3                    -- speculation on, for context (left out with ``--off-only``)
* one class off               -- batch 1 only: requests alternate between a class switched
                                 off and a class at N=3; the off class's tokens/s vs plain
                                 on the same prompts

It prints tokens/s per arm, the ratio to plain over the same waves, and the
draft-model forward passes each draft arm ran (0 = the drafter never ran).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from spectune.engine import ClassSettings, EngineConfig, MemorySink, RequestRecord, RuntimeSettings
from spectune.engine.core import GenerationRequest, SpecEngine
from spectune.engine.models.prepare import demo_pair_paths

from .speedup import PROMPTS as SPEEDUP_PROMPTS
from .tuner_replay.workloads import WORKLOADS

PROMPTS = (
    *WORKLOADS["chat"].prompts,
    *WORKLOADS["code_edit"].prompts,
    *SPEEDUP_PROMPTS.values(),
    "Question: What is a deadlock, and how can a program avoid one?\nAnswer:",
)
CONCURRENCY = (1, 4, 8)
CAPACITY = 3
OFF_CLASS, ON_CLASS = "qa", "long"


@dataclass(frozen=True)
class Arm:
    name: str
    engine: str  # plain | spec
    settings: RuntimeSettings
    mixed: bool = False  # alternate OFF_CLASS / ON_CLASS requests (batch 1 only)


def _n(n: int) -> RuntimeSettings:
    return RuntimeSettings(num_speculative_tokens=n, speculation_enabled=n > 0)


def arms(method: str, off_only: bool = False) -> tuple[Arm, ...]:
    short = "draft" if method == "draft_model" else method
    every = (
        Arm("plain (--method none)", "plain", _n(0)),
        Arm(f"{short} N=0", "spec", _n(0)),
        Arm(f"{short} N=1", "spec", _n(1)),
        Arm(f"{short} N=3", "spec", _n(3)),
        Arm(
            f"{short}, class {OFF_CLASS} off, {ON_CLASS} N=3",
            "spec",
            RuntimeSettings(num_speculative_tokens=3, classes={OFF_CLASS: ClassSettings(speculation_enabled=False)}),
            mixed=True,
        ),
    )
    return tuple(a for a in every if not (off_only and a.name in (f"{short} N=1", f"{short} N=3")))


def engine_config(target: str, method: str, draft: str | None) -> EngineConfig:
    return EngineConfig(
        model=target,
        method=method,
        draft_model=draft,
        max_speculative_tokens=CAPACITY,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_space_gib=1,
        instance_id=f"bench-{method}",
        initial=_n(0),
    )


async def run_wave(
    engine: SpecEngine, sink: MemorySink, wave: list[int], max_tokens: int, mixed: bool
) -> tuple[float, list[RequestRecord]]:
    """Wall seconds and records of the PROMPTS in ``wave``, all sent at once."""
    before = len(sink.records)

    async def one(i: int) -> None:
        prompt_class = (OFF_CLASS if i % 2 == 0 else ON_CLASS) if mixed else None
        req = GenerationRequest(
            prompt=PROMPTS[i],
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            prompt_class=prompt_class,
            request_id=f"p{i}-{time.monotonic_ns()}",
        )
        async for _ in engine.generate(req):
            pass

    start = time.perf_counter()
    await asyncio.gather(*[one(i) for i in wave])
    return time.perf_counter() - start, list(sink.records)[before:]


def _prompt_index(record: RequestRecord) -> int:
    return int(record.request_id.split("-")[0][1:])


def sequential_tok_s(records: list[RequestRecord], keep: set[int]) -> float:
    """tokens/s of the kept prompts served one at a time (their own e2e time)."""
    kept = [r for r in records if _prompt_index(r) in keep]
    return sum(r.output_tokens for r in kept) / sum(r.e2e_s for r in kept)


async def main(method: str, max_tokens: int, passes: int, out: Path | None, off_only: bool = False) -> None:
    console = Console()
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    engines: dict[str, tuple[SpecEngine, MemorySink]] = {}
    draft_model = pair["draft"] if method == "draft_model" else None
    counts_forwards = method == "draft_model"
    for name, engine_method, draft in (("plain", "none", None), ("spec", method, draft_model)):
        sink = MemorySink()
        engine = SpecEngine(engine_config(pair["target"], engine_method, draft), [sink])
        await engine.start()
        if engine.degraded_reason:
            raise RuntimeError(f"{name} engine degraded: {engine.degraded_reason}")
        await run_wave(engine, sink, [0, 1, 2, 3], 8, False)  # warm-up
        engines[name] = (engine, sink)
        console.log(f"{name} engine up")
    version = 0
    tokens: dict[tuple[str, int], int] = defaultdict(int)
    seconds: dict[tuple[str, int], float] = defaultdict(float)
    records: dict[tuple[str, int], list[RequestRecord]] = defaultdict(list)
    forwards: dict[tuple[str, int], int] = defaultdict(int)
    try:
        for concurrency in CONCURRENCY:
            # Arms alternate wave by wave (a wave = `concurrency` prompts sent together), so
            # every arm sees the machine at nearly the same moments.
            waves = [list(range(i, min(i + concurrency, len(PROMPTS)))) for i in range(0, len(PROMPTS), concurrency)]
            for _ in range(passes):
                for w, wave in enumerate(waves):
                    for arm in arms(method, off_only):
                        if arm.mixed and concurrency != 1:
                            continue
                        key = (arm.name, concurrency)
                        engine, sink = engines[arm.engine]
                        version += 1
                        await engine.apply(arm.settings.model_copy(update={"version": version}))
                        counted = counts_forwards and arm.engine == "spec"
                        before = await engine.count_draft_forwards() if counted else 0
                        elapsed, done = await run_wave(engine, sink, wave, max_tokens, arm.mixed)
                        if counted:
                            forwards[key] += await engine.count_draft_forwards() - before
                        tokens[key] += sum(r.output_tokens for r in done)
                        seconds[key] += elapsed
                        records[key].extend(done)
                    console.log(f"c={concurrency} wave {w + 1}/{len(waves)} done")
    finally:
        for engine, _ in engines.values():
            await engine.shutdown()

    off = {i for i in range(len(PROMPTS)) if i % 2 == 0}
    tok_s, ratio = {}, {}
    for (name, concurrency), n_tokens in tokens.items():
        plain_key = (arms(method)[0].name, concurrency)
        if name.endswith(f"{ON_CLASS} N=3"):  # the mixed arm: its off-class requests vs plain on the same prompts
            tok_s[(name, concurrency)] = sequential_tok_s(records[(name, concurrency)], off)
            base = sequential_tok_s(records[plain_key], off)
        else:
            tok_s[(name, concurrency)] = n_tokens / seconds[(name, concurrency)]
            base = tokens[plain_key] / seconds[plain_key]
        ratio[(name, concurrency)] = tok_s[(name, concurrency)] / base

    lines = [
        f"Demo pair (Qwen2.5-Coder 1.5B, draft 0.5B), --method {method} vs a plain engine, bf16, greedy, "
        f"{len(PROMPTS)} prompts x {max_tokens} tokens, "
        f"arms alternating wave by wave ({passes} pass(es)). Ratio: against the plain engine on the same waves. "
        "For the one-class-off arm (batch 1, classes alternating) tok/s is the off class's requests "
        "against the plain engine on the same prompts. Draft forwards: the draft model's forward passes in the arm.",
        "",
        "| arm | concurrent | tok/s | vs plain | draft forwards |",
        "|---|---|---|---|---|",
    ]
    for concurrency in CONCURRENCY:
        for arm in arms(method, off_only):
            key = (arm.name, concurrency)
            if key not in tok_s:
                continue
            fw = forwards[key] if counts_forwards and arm.engine == "spec" else "-"
            lines.append(f"| {arm.name} | {concurrency} | {tok_s[key]:.2f} | {ratio[key]:.3f}x | {fw} |")
    text = "\n".join(lines) + "\n"
    console.print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        console.print(f"written {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["draft_model", "ngram", "suffix"], default="draft_model")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--off-only", action="store_true", help="only plain, N=0 and one-class-off (half the time)")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/off_state_<method>.md")
    args = parser.parse_args()
    out = args.out or Path(f"benchmarks/results/off_state_{args.method}.md")
    asyncio.run(main(args.method, args.max_tokens, args.passes, out, args.off_only))
