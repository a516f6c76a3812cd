"""What a draft diagnosis costs the engine serving next to it (demo pair).

    python -m benchmarks.diagnosis_overhead [--windows 3] [--window-s 60] [--cpu-share 0.25] [--prompts 4]

One draft-model engine (demo pair, bf16, N=3) serves closed-loop batch-1 requests
throughout.  Windows alternate: ``--window-s`` without a diagnosis, then exactly one
diagnosis running in spectune's worker process (``DiagnosisRunner``: spawned, nice
19, one torch thread, ``--cpu-share`` of a core; target and draft in fp32,
teacher-forced), from its submission until it finishes.  Reports tokens/s per
window, the ratio with / without (median over the window pairs) and how long each
diagnosis took.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from sqlalchemy import select

from spectune.engine import MemorySink, RuntimeSettings
from spectune.engine.core import GenerationRequest, SpecEngine
from spectune.engine.models.prepare import demo_pair_paths
from spectune.store.db import make_engine, upgrade
from spectune.store.models import DiagnosticsReport
from spectune.tuner.diagnosis_job import DiagnosisRunner

from .off_state import PROMPTS, engine_config


async def serve_for(engine: SpecEngine, seconds: float, max_tokens: int) -> tuple[int, float]:
    """Closed-loop batch-1 requests for ``seconds`` (whole requests): (tokens, elapsed s)."""
    tokens, start, k = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        req = GenerationRequest(prompt=PROMPTS[k % len(PROMPTS)], max_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True)  # fmt: skip
        async for delta in engine.generate(req):
            tokens += len(delta.token_ids)
        k += 1
    return tokens, time.perf_counter() - start


async def main(
    windows: int, window_s: float, max_tokens: int, cpu_share: float, prompts: int, out: Path | None
) -> None:
    console = Console()
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    config = engine_config(pair["target"], "draft_model", pair["draft"]).model_copy(
        update={"initial": RuntimeSettings(num_speculative_tokens=3)}
    )
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/diag.db"
        upgrade(url)
        db = make_engine(url)
        runner = DiagnosisRunner(db, lambda: (pair["target"], pair["draft"]), cpu_share)
        engine = SpecEngine(config, [MemorySink()])
        await engine.start()
        rows: list[tuple[float, float, float]] = []  # (alone, beside a diagnosis) tok/s, its seconds
        diagnoses = 0
        try:
            await serve_for(engine, 20, max_tokens)  # warm-up
            for w in range(windows):
                tokens, seconds = await serve_for(engine, window_s, max_tokens)
                alone = tokens / seconds
                # The other window lasts exactly one diagnosis: what the engine serves while one runs.
                _, future = runner.submit("benchmark", None, max_prompts=prompts)
                diagnoses += 1
                tokens = seconds = 0
                while not future.done():
                    t, s = await serve_for(engine, 1, max_tokens)
                    tokens, seconds = tokens + t, seconds + s
                report = future.result()
                with db.connect() as conn:
                    query = select(DiagnosticsReport.status).where(DiagnosticsReport.id == report)
                    status = conn.execute(query).scalar()
                if status != "done":
                    raise RuntimeError(f"diagnosis {report} ended {status!r}: the window measured no diagnosis")
                beside = tokens / seconds
                rows.append((alone, beside, seconds))
                console.log(f"window {w}: alone {alone:.2f} tok/s, beside diagnosis {report} ({seconds:.0f} s) "
                            f"{beside:.2f} ({beside / alone:.3f}x)")  # fmt: skip
        finally:
            await engine.shutdown()
            runner.shutdown()
        ratio = statistics.median(b / a for a, b, _ in rows)
        lines = [
            f"Demo pair, bf16, N=3, batch 1, {max_tokens} tokens/request; windows alternating: {window_s:g} s "
            f"without a diagnosis, then one whole diagnosis ({prompts} prompts) in the worker process at CPU share "
            f"{runner.cpu_share:g}; {diagnoses} diagnoses.",
            "",
            "| window | alone (tok/s) | beside a diagnosis (tok/s) | ratio | diagnosis took |",
            "|---|---|---|---|---|",
            *[f"| {i} | {a:.2f} | {b:.2f} | {b / a:.3f}x | {s:.0f} s |" for i, (a, b, s) in enumerate(rows)],
            "",
            f"Median ratio: {ratio:.3f}x ({(1 - ratio):+.1%} cost to the engine's tokens/s).",
        ]
        console.print("\n".join(lines))
        if out:
            out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cpu-share", type=float, default=0.25, help="the diagnosis worker's CPU share")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per diagnosis (its length)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/diagnosis_overhead.md"))
    args = parser.parse_args()
    asyncio.run(main(args.windows, args.window_s, args.max_tokens, args.cpu_share, args.prompts, args.out))
