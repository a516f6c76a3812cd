"""The replay's workloads: prompt sets and sampling per phase kind.

``chat`` is short-answer Q&A and explanation; ``code_edit`` asks to rewrite
code shown in the prompt (copy-heavy: the draft agrees most of the time);
``domain_shift`` asks for continuations of random identifiers at a high
temperature, where a small draft and its target disagree.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

_CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
"""


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]
    temperature: float


def _random_ids(seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(5, 11))) for _ in range(24)]
    return "Session keys: " + ", ".join(words) + ","


WORKLOADS = {
    "chat": Workload(
        "chat",
        (
            "Question: What does the HTTP status code 404 mean? Answer in two sentences.\nAnswer:",
            "Question: Why do databases use indexes? Explain briefly.\nAnswer:",
            "Question: What is the difference between a process and a thread?\nAnswer:",
            "Question: How does a hash map handle collisions?\nAnswer:",
            "Question: What is a race condition? Give an example.\nAnswer:",
            "Question: Why is TCP called a reliable protocol?\nAnswer:",
        ),
        0.7,
    ),
    "code_edit": Workload(
        "code_edit",
        tuple(
            f"Rewrite the following Python function, renaming `{old}` to `{new}` everywhere and "
            f"changing nothing else.\n\n```python\n{_CODE}```\n\nRewritten:\n```python\n"
            for old, new in (
                ("subtotal", "net"),
                ("items", "lines"),
                ("tax_rate", "rate"),
                ("item", "entry"),
                ("tax", "vat"),
                ("total_price", "gross_total"),
            )
        ),
        0.0,
    ),
    "domain_shift": Workload("domain_shift", tuple(_random_ids(seed) for seed in range(6)), 1.3),
}
