"""Speculation on vs off on the real demo pair, side by side in one run.

    python benchmarks/speedup.py [--max-tokens 48] [--out benchmarks/results/speedup.md]

For batch 1 and 4, greedy and temperature 0.8, three prompt kinds (Q&A,
code, summarise-with-copying): tokens/s of a plain engine (``--method none``,
the baseline of every ratio), ngram and draft model at N in {0,1,3,5} (N
switched at runtime on one engine per method; N=0 shows what "off" costs), the
measured acceptance alpha, the measured cost ratio c (draft tokens/s vs target
tokens/s, each served alone at batch 1) and the Leviathan bound (1 - alpha^(N+1)) / ((1 - alpha)(N c + 1)).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from spectune.engine import EngineConfig, MemorySink, RuntimeSettings
from spectune.engine.core import GenerationRequest, SpecEngine
from spectune.engine.models.prepare import demo_pair_paths

PROMPTS = {
    "qa": "Question: What does the HTTP status code 404 mean? Answer in one sentence.\nAnswer:",
    "code": "# Python\ndef merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n',
    "copy": "Summarise the following text, reusing its wording.\n\nText: The scheduler reads the "
    "request records every minute, estimates the acceptance rate of each prompt class, and "
    "lowers the speculation length when the draft model stops paying for itself. When the "
    "acceptance rate recovers, the scheduler raises the speculation length again.\n\nSummary: The scheduler",
}
BATCHES = (1, 4)
TEMPERATURES = (0.0, 0.8)
NS = (1, 3, 5)


@dataclass
class Cell:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def leviathan(alpha: float | None, n: int, c: float) -> float | None:
    if alpha is None:
        return None
    if alpha >= 1.0:
        return (n + 1) / (n * c + 1)
    return (1 - alpha ** (n + 1)) / ((1 - alpha) * (n * c + 1))


async def measure(engine: SpecEngine, sink: MemorySink, batch: int, temperature: float, max_tokens: int) -> Cell:
    cell = Cell()
    kinds = list(PROMPTS)
    # batch 1: each kind alone; batch 4: four concurrent requests cycling the kinds.
    rounds = [[k] for k in kinds] if batch == 1 else [[kinds[i % 3] for i in range(batch)]]
    for group in rounds:
        before = len(sink.records)
        start = time.perf_counter()

        async def one(kind: str, i: int) -> None:
            req = GenerationRequest(
                prompt=PROMPTS[kind], max_tokens=max_tokens, temperature=temperature, seed=1234 + i, ignore_eos=True
            )
            async for _ in engine.generate(req):
                pass

        await asyncio.gather(*[one(k, i) for i, k in enumerate(group)])
        cell.seconds += time.perf_counter() - start
        for r in list(sink.records)[before:]:
            cell.tokens += r.output_tokens
            cell.drafted += r.num_draft_tokens
            cell.accepted += r.num_accepted_tokens
    return cell


def config(model: str, method: str, draft: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=model,
        method=method,
        draft_model=draft,
        num_speculative_tokens=max(NS),
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_space_gib=4,
        instance_id="bench",
        initial=RuntimeSettings(num_speculative_tokens=max(NS)),
    )


async def run_engine(cfg: EngineConfig, ns: tuple[int, ...], max_tokens: int, console: Console) -> dict:
    sink = MemorySink()
    engine = SpecEngine(cfg, [sink])
    await engine.start()
    if engine.degraded_reason:
        raise RuntimeError(f"engine degraded: {engine.degraded_reason}")
    results = {}
    try:
        await measure(engine, sink, 1, 0.0, 8)  # warm-up
        for n in ns:
            await engine.apply(RuntimeSettings(version=n + 1, num_speculative_tokens=n, speculation_enabled=n > 0))
            for batch in BATCHES:
                for temp in TEMPERATURES:
                    cell = await measure(engine, sink, batch, temp, max_tokens)
                    results[(n, batch, temp)] = cell
                    console.log(f"{cfg.method} N={n} batch={batch} T={temp}: {cell.tok_s:.2f} tok/s alpha={cell.alpha}")
    finally:
        await engine.shutdown()
    return results


async def main(max_tokens: int, out: Path | None) -> None:
    console = Console()
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    off = await run_engine(config(pair["target"], "none"), (0,), max_tokens, console)
    draft_alone = await run_engine(config(pair["draft"], "none"), (0,), max_tokens, console)
    c = off[(0, 1, 0.0)].tok_s / draft_alone[(0, 1, 0.0)].tok_s
    ngram = await run_engine(config(pair["target"], "ngram"), (0, *NS), max_tokens, console)
    draft = await run_engine(config(pair["target"], "draft_model", pair["draft"]), (0, *NS), max_tokens, console)

    table = Table(
        title=f"Speculation vs a plain engine, Qwen2.5-Coder 1.5B (draft 0.5B), bf16, {max_tokens} tokens/request, "
        f"c={c:.2f}"
    )
    for col in ("method", "N", "batch", "T", "tok/s", "speedup", "alpha", "bound"):
        table.add_column(col, justify="right")
    rows = []
    for batch in BATCHES:
        for temp in TEMPERATURES:
            base = off[(0, batch, temp)]
            rows.append(("plain", 0, batch, temp, base.tok_s, 1.0, None, None))
            for name, res, cost in (("ngram", ngram, 0.0), ("draft", draft, c)):
                for n in (0, *NS):
                    cell = res[(n, batch, temp)]
                    rows.append(
                        (
                            name,
                            n,
                            batch,
                            temp,
                            cell.tok_s,
                            cell.tok_s / base.tok_s,
                            cell.alpha,
                            leviathan(cell.alpha, n, cost),
                        )
                    )
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for name, n, batch, temp, tps, speed, alpha, bound in rows:
        table.add_row(name, str(n), str(batch), str(temp), f"{tps:.2f}", f"{speed:.2f}x", fmt(alpha), fmt(bound))
    console.print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            f"Measured cost ratio c = {c:.3f} (draft alone {draft_alone[(0, 1, 0.0)].tok_s:.2f} tok/s, "
            f"target alone {off[(0, 1, 0.0)].tok_s:.2f} tok/s, batch 1 greedy).",
            "",
            "| method | N | batch | T | tok/s | speedup | alpha | Leviathan bound |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]:.2f}x | {fmt(r[6])} | {fmt(r[7])} |"
            for r in rows
        ]
        out.write_text("\n".join(lines) + "\n")
        console.print(f"written {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speedup.md"))
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.out))
