"""Acceptance after speculation resumes, against requests that never paused (demo pair).

    python -m benchmarks.resume_acceptance [--max-tokens 32] [--out FILE]

One draft-model engine (demo pair, bf16, greedy, N capacity 3).  Two sittings, each
the same 16 prompts, two at a time, next to two long background requests:

* never paused -- N=3 throughout: the background requests speculate too.
(The background requests run 160 tokens and finish during the measured phase.)
* resumed      -- the background requests start at N=3, speculation goes off
                  (N=0: no draft forward runs, the background requests are demoted
                  for good) and on again (N=3) while they run; then the 16 prompts.

With a free off state the draft KV of a request admitted after resuming is built
from its own prefill, so its acceptance should equal the never-paused sitting's
(bf16 batch-shape numerics aside).  Prints acceptance (accepted / drafted) per
sitting, the difference in points, per-prompt differences, and what the demoted
background requests drafted after going off (0 expected).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from rich.console import Console

from spectune.engine import MemorySink, RequestRecord
from spectune.engine.core import GenerationRequest, SpecEngine
from spectune.engine.models.prepare import demo_pair_paths

from .off_state import PROMPTS, _n, engine_config

BACKGROUND_TOKENS = 160


async def _request(engine: SpecEngine, prompt: str, max_tokens: int, tag: str) -> None:
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            request_id=f"{tag}-{time.monotonic_ns()}")  # fmt: skip
    async for _ in engine.generate(req):
        pass


async def sitting(engine: SpecEngine, sink: MemorySink, max_tokens: int, pause: bool, version: int) -> dict:
    await engine.apply(_n(3).model_copy(update={"version": version}))
    background = [asyncio.create_task(_request(engine, PROMPTS[i], BACKGROUND_TOKENS, f"bg{i}")) for i in (0, 1)]
    forwards_while_off = None
    if pause:
        await _steps(sink, 8)  # the background requests are decoding with drafts
        await engine.apply(_n(0).model_copy(update={"version": version + 1}))
        await _steps(sink, 1)
        at_off = await engine.count_draft_forwards()
        await _steps(sink, 8)  # steps with nothing speculating
        forwards_while_off = await engine.count_draft_forwards() - at_off
        await engine.apply(_n(3).model_copy(update={"version": version + 2}))
    before = len(sink.records)
    for i in range(0, len(PROMPTS), 2):
        await asyncio.gather(*[_request(engine, PROMPTS[j], max_tokens, f"p{j}") for j in (i, i + 1)])
    measured = [r for r in list(sink.records)[before:] if r.request_id.startswith("p")]
    await asyncio.gather(*background)  # finished, not cut: an aborted request's record carries no draft counts
    background_records = [r for r in list(sink.records)[before:] if r.request_id.startswith("bg")]
    return {"measured": measured, "background": background_records, "forwards_while_off": forwards_while_off}


async def _steps(sink: MemorySink, n: int) -> None:
    """Until the engine ran ``n`` more steps."""
    target = len(sink.steps) + n
    while len(sink.steps) < target:
        await asyncio.sleep(0.02)


def _acceptance(records: list[RequestRecord]) -> float:
    return sum(r.num_accepted_tokens for r in records) / max(1, sum(r.num_draft_tokens for r in records))


async def main(max_tokens: int, out: Path | None) -> None:
    console = Console()
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    sink = MemorySink()
    engine = SpecEngine(engine_config(pair["target"], "draft_model", pair["draft"]), [sink])
    await engine.start()
    try:
        if engine.degraded_reason:
            raise RuntimeError(f"engine degraded: {engine.degraded_reason}")
        await _request(engine, PROMPTS[2], 8, "warm")
        never = await sitting(engine, sink, max_tokens, pause=False, version=10)
        console.log("never-paused sitting done")
        resumed = await sitting(engine, sink, max_tokens, pause=True, version=20)
        console.log("resumed sitting done")
    finally:
        await engine.shutdown()
    a_never, a_resumed = _acceptance(never["measured"]), _acceptance(resumed["measured"])
    by_prompt = {r.request_id.split("-")[0]: r for r in never["measured"]}
    diffs = []
    for r in resumed["measured"]:
        base = by_prompt[r.request_id.split("-")[0]]
        diffs.append(
            r.num_accepted_tokens / max(1, r.num_draft_tokens)
            - base.num_accepted_tokens / max(1, base.num_draft_tokens)
        )
    demoted = resumed["background"]
    lines = [
        f"Demo pair, bf16, greedy, draft model N=3, {len(PROMPTS)} prompts x {max_tokens} tokens, two at a time "
        f"next to two background requests; `python -m benchmarks.resume_acceptance`.",
        "",
        "| sitting | requests | drafted | accepted | acceptance |",
        "|---|---|---|---|---|",
    ]
    for name, result, rate in (("never paused", never, a_never), ("after off -> on", resumed, a_resumed)):
        m = result["measured"]
        lines.append(f"| {name} | {len(m)} | {sum(r.num_draft_tokens for r in m)} | "
                     f"{sum(r.num_accepted_tokens for r in m)} | {rate:.3f} |")  # fmt: skip
    lines += [
        "",
        f"Difference: {100 * (a_resumed - a_never):+.1f} points; per prompt: max |diff| "
        f"{100 * max(abs(d) for d in diffs):.1f} points, {sum(abs(d) > 1e-9 for d in diffs)} of {len(diffs)} differ.",
        f"Draft-model forwards in the 8 steps while off: {resumed['forwards_while_off']}. Background requests' "
        f"verify steps: never paused {[r.num_spec_steps for r in never['background']]}, demoted at off and never "
        f"promoted {[r.num_spec_steps for r in demoted]} (all before the switch).",
    ]
    text = "\n".join(lines) + "\n"
    console.print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/resume_acceptance.md"))
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.out))
