"""Which method pays on which class: ngram, suffix decoding and the draft model against plain serving.

    python -m benchmarks.methods [--max-tokens 64] [--prompts 4] [--arms ngram:3,ngram:6,suffix:6]
                                 [--out benchmarks/results/methods.md]

Demo pair (Qwen2.5-Coder 1.5B, draft 0.5B), bf16, greedy, batch 1, two classes of prompts of our
own: copy-heavy code edits (the same code back with a name changed) and chat questions, up to 8
each (``--prompts``; on this 2-core CPU a plain 64-token request takes about 15 s).  A
plain engine (``--method none``) is up throughout; the speculative engines come up one at a time
beside it (three demo-pair engines do not fit in 24 GiB).  Every request of a speculative arm is
served right after the same prompt on the plain engine, and its ratio is against those plain
runs (sums of tokens over sums of seconds).  N is set at run time on each engine (capacity 6).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from spectune.engine import EngineConfig, MemorySink, RuntimeSettings
from spectune.engine.core import GenerationRequest, SpecEngine
from spectune.engine.models.prepare import demo_pair_paths

from .off_state import engine_config
from .speedup import Cell, started

CAPACITY = 6
_CODE = [
    "def total(items):\n    tmp = 0\n    for item in items:\n        tmp += item.price * item.count\n    return tmp\n",
    "def longest(words):\n    tmp = ''\n    for word in words:\n        if len(word) > len(tmp):\n"
    "            tmp = word\n    return tmp\n",
    "def mean(values):\n    if not values:\n        return 0.0\n    tmp = sum(values)\n    return tmp / len(values)\n",
    "def flatten(rows):\n    tmp = []\n    for row in rows:\n        for cell in row:\n            tmp.append(cell)\n"
    "    return tmp\n",
    "def count_words(text):\n    tmp = {}\n    for word in text.split():\n        tmp[word] = tmp.get(word, 0) + 1\n"
    "    return tmp\n",
    "def clamp_all(values, lo, hi):\n    tmp = []\n    for v in values:\n        tmp.append(min(hi, max(lo, v)))\n"
    "    return tmp\n",
    "def first_even(numbers):\n    tmp = None\n    for n in numbers:\n        if n % 2 == 0:\n            tmp = n\n"
    "            break\n    return tmp\n",
    "def join_names(people):\n    tmp = []\n    for person in people:\n"
    "        tmp.append(person.first + ' ' + person.last)\n    return ', '.join(tmp)\n",
]
CODE_EDITS = [
    "Rename the variable `tmp` to `result` in this Python function. Reply with the code only.\n\n"
    f"```python\n{code}```\n\n```python\n"
    for code in _CODE
]
CHAT = [
    "Question: What does the HTTP status code 404 mean?\nAnswer:",
    "Question: Why do databases use indexes?\nAnswer:",
    "Question: What is the difference between a process and a thread?\nAnswer:",
    "Question: How does a hash map handle collisions?\nAnswer:",
    "Question: What is a race condition?\nAnswer:",
    "Question: Why is floating point addition not associative?\nAnswer:",
    "Question: What does a load balancer do?\nAnswer:",
    "Question: What is the purpose of a unit test?\nAnswer:",
]
CLASSES = {"code edit": CODE_EDITS, "chat": CHAT}
DEFAULT_ARMS = "ngram:3,ngram:6,suffix:6"  # the draft model is in benchmarks/speedup.py


@dataclass
class Tally:
    """One (method, N, class): its requests and the plain runs of the same prompts."""

    spec: Cell = field(default_factory=Cell)
    plain: Cell = field(default_factory=Cell)
    per_position: list[int] = field(default_factory=lambda: [0] * CAPACITY)

    def speedup(self) -> float:
        return self.spec.tok_s / self.plain.tok_s


def config(target: str, method: str, draft: str | None) -> EngineConfig:
    """``off_state``'s engine (bf16, off at start), with room for N = 6."""
    return engine_config(target, method, draft).model_copy(update={"max_speculative_tokens": CAPACITY})


async def serve(engine: SpecEngine, sink: MemorySink, prompt: str, max_tokens: int):
    """One request alone; its wall seconds and record."""
    before = len(sink.records)
    start = time.perf_counter()
    request = GenerationRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(request):
        pass
    return time.perf_counter() - start, sink.records[before]


def parse_arms(spec: str) -> list[tuple[str, int]]:
    arms = []
    for part in spec.split(","):
        method, _, n = part.partition(":")
        if method not in ("ngram", "suffix", "draft_model") or not n.isdigit() or not 1 <= int(n) <= CAPACITY:
            raise argparse.ArgumentTypeError(
                f"bad arm {part!r}: METHOD:N, METHOD ngram|suffix|draft_model, N 1-{CAPACITY}"
            )
        arms.append((method, int(n)))
    return arms


async def main(max_tokens: int, prompts_per_class: int, arms: list[tuple[str, int]], out: Path | None) -> None:
    console = Console()
    classes = {name: prompts[:prompts_per_class] for name, prompts in CLASSES.items()}
    pair = {k: str(v) for k, v in demo_pair_paths().items()}
    plain = await started(config(pair["target"], "none", None))
    tallies: dict[tuple[str, int, str], Tally] = {}
    try:
        for method in dict.fromkeys(m for m, _ in arms):
            spec = await started(config(pair["target"], method, pair["draft"] if method == "draft_model" else None))
            try:
                for version, n in enumerate((n for m, n in arms if m == method), start=1):
                    await spec[0].apply(RuntimeSettings(version=version, num_speculative_tokens=n))
                    for name, prompts in classes.items():
                        tally = tallies.setdefault((method, n, name), Tally())
                        for prompt in prompts:
                            plain_s, plain_record = await serve(*plain, prompt, max_tokens)
                            spec_s, record = await serve(*spec, prompt, max_tokens)
                            tally.plain.tokens += plain_record.output_tokens
                            tally.plain.seconds += plain_s
                            tally.spec.tokens += record.output_tokens
                            tally.spec.seconds += spec_s
                            tally.spec.drafted += record.num_draft_tokens
                            tally.spec.accepted += record.num_accepted_tokens
                            for j, a in enumerate(record.accepted_per_position):
                                tally.per_position[j] += a
                        console.log(
                            f"{method} N={n} {name}: {tally.speedup():.2f}x plain, "
                            f"acceptance {tally.spec.alpha or 0:.2f}"
                        )
            finally:
                await spec[0].shutdown()
    finally:
        await plain[0].shutdown()

    lines = [
        f"Demo pair, bf16, greedy, batch 1, {max_tokens} tokens per request, {prompts_per_class} prompts per "
        "class; each speculative request right after the same prompt on a plain engine (`--method none`) that is up "
        "throughout; speedup = tokens/s over the plain runs' tokens/s.",
        "",
        "| class | method | N | tok/s | plain tok/s | speedup | acceptance | accepted tokens per verify position |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in classes:
        for method, n in arms:
            t = tallies[(method, n, name)]
            acceptance = "-" if t.spec.alpha is None else f"{t.spec.alpha:.2f}"
            lines.append(
                f"| {name} | {method} | {n} | {t.spec.tok_s:.2f} | {t.plain.tok_s:.2f} "
                f"| {t.speedup():.2f}x | {acceptance} | {' / '.join(str(a) for a in t.per_position[:n])} |"
            )
    console.print("\n".join(lines))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        console.print(f"written {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4, choices=range(1, 9), metavar="1-8")
    parser.add_argument("--arms", type=parse_arms, default=parse_arms(DEFAULT_ARMS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/methods.md"))
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.prompts, args.arms, args.out))
