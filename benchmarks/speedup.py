"""Speculation on vs off on the real demo pair, side by side in one run.

    python benchmarks/speedup.py [--max-tokens 48] [--out benchmarks/results/speedup.md]

For batch 1 and 4, greedy and temperature 0.8, three prompt kinds (Q&A,
code, summarise-with-copying): tokens/s of a plain engine (``--method none``,
the baseline of every ratio, up throughout and measured right before every
cell), ngram and draft model at N in {0,1,3,5} (N switched at runtime on one
engine per method; N=0 shows what "off" costs), the
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
        max_speculative_tokens=max(NS),
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_space_gib=2,  # two engines at once
        instance_id="bench",
        initial=RuntimeSettings(num_speculative_tokens=max(NS)),
    )


async def started(cfg: EngineConfig) -> tuple[SpecEngine, MemorySink]:
    sink = MemorySink()
    engine = SpecEngine(cfg, [sink])
    await engine.start()
    if engine.degraded_reason:
        raise RuntimeError(f"engine degraded: {engine.degraded_reason}")
    await measure(engine, sink, 1, 0.0, 8)  # warm-up
    return engine, sink


async def main(max_tokens: int, out: Path | None) -> None:
    """Two engines up at once (three demo-pair engines do not fit in 24 GiB): the plain engine
    throughout, and in turn the draft alone (for c) and each speculative method.  Every cell of a
    speculative engine is measured right after the same cell of the plain engine, and its ratio is
    against that measurement, so both see the machine at nearly the same moment."""
    console = Console()
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    plain = await started(config(pair["target"], "none"))
    plain_cells: dict[tuple[int, float], list[Cell]] = {}
    paired: dict[tuple[str, int, int, float], tuple[Cell, Cell]] = {}  # (method, N, batch, T) -> (plain, spec)
    try:
        draft_alone = await started(config(pair["draft"], "none"))
        target_1, draft_1 = Cell(), Cell()
        for _ in range(2):  # alternating, summed: c = draft tok/s over target tok/s at batch 1, greedy
            for total, (engine, sink) in ((target_1, plain), (draft_1, draft_alone)):
                cell = await measure(engine, sink, 1, 0.0, max_tokens)
                total.tokens, total.seconds = total.tokens + cell.tokens, total.seconds + cell.seconds
        await draft_alone[0].shutdown()
        c = target_1.tok_s / draft_1.tok_s
        console.log(f"c = {c:.3f} (target {target_1.tok_s:.2f} tok/s, draft {draft_1.tok_s:.2f} tok/s)")
        for method in ("ngram", "draft_model"):
            spec = await started(config(pair["target"], method, pair["draft"] if method == "draft_model" else None))
            try:
                for n in (0, *NS):
                    await spec[0].apply(
                        RuntimeSettings(version=n + 1, num_speculative_tokens=n, speculation_enabled=n > 0)
                    )
                    for batch in BATCHES:
                        for temp in TEMPERATURES:
                            base = await measure(*plain, batch, temp, max_tokens)
                            cell = await measure(*spec, batch, temp, max_tokens)
                            plain_cells.setdefault((batch, temp), []).append(base)
                            paired[(method, n, batch, temp)] = (base, cell)
                            console.log(f"{method} N={n} batch={batch} T={temp}: {cell.tok_s / base.tok_s:.2f}x plain")
            finally:
                await spec[0].shutdown()
    finally:
        await plain[0].shutdown()

    table = Table(
        title=f"Speculation vs a plain engine, Qwen2.5-Coder 1.5B (draft 0.5B), bf16, {max_tokens} tokens/request, "
        f"c={c:.2f}"
    )
    for col in ("method", "N", "batch", "T", "tok/s", "speedup", "alpha", "bound"):
        table.add_column(col, justify="right")
    rows = []
    for batch in BATCHES:
        for temp in TEMPERATURES:
            bases = plain_cells[(batch, temp)]
            mean_plain = sum(b.tok_s for b in bases) / len(bases)
            rows.append(("plain (--method none)", 0, batch, temp, mean_plain, 1.0, None, None))
            for method, name, cost in (("ngram", "ngram", 0.0), ("draft_model", "draft", c)):
                for n in (0, *NS):
                    base, cell = paired[(method, n, batch, temp)]
                    bound = leviathan(cell.alpha, n, cost)
                    rows.append((name, n, batch, temp, cell.tok_s, cell.tok_s / base.tok_s, cell.alpha, bound))
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for name, n, batch, temp, tps, speed, alpha, bound in rows:
        table.add_row(name, str(n), str(batch), str(temp), f"{tps:.2f}", f"{speed:.2f}x", fmt(alpha), fmt(bound))
    console.print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            f"Measured cost ratio c = {c:.3f} (draft alone {draft_1.tok_s:.2f} tok/s, target alone "
            f"{target_1.tok_s:.2f} tok/s, batch 1 greedy, alternating). The plain engine (`--method none`) and "
            "the speculative one are up together; each cell of the speculative engine is measured right after "
            "the same cell of the plain engine and its speedup is against that measurement (the plain row "
            "shows the mean of its measurements). N=0 is speculation switched off at runtime.",
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
