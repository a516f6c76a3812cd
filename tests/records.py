"""Synthetic RequestRecords for store tests (engine-free)."""

from __future__ import annotations

import random
import time

from spectune.engine.schema import RequestRecord


def make_records(n: int, prefix: str = "r", seed: int = 0, instance: str = "i-1") -> list[RequestRecord]:
    rng = random.Random(seed)
    now = time.time()
    out = []
    for i in range(n):
        drafted = [rng.randint(5, 9)] * 4
        accepted = sorted((rng.randint(0, d) for d in drafted), reverse=True)
        arrival = now - rng.random() * 60
        out.append(
            RequestRecord(
                request_id=f"{prefix}-{i}",
                instance_id=instance,
                model="m",
                prompt_class=rng.choice(["qa", "long"]),
                arrival_time=arrival,
                first_token_time=arrival + 0.05,
                finish_time=arrival + 1.0,
                prompt_tokens=rng.randint(5, 200),
                output_tokens=40,
                ttft_s=0.05,
                tpot_s=0.02,
                e2e_s=1.0,
                speculation_method="draft_model",
                speculation_enabled=True,
                num_speculative_tokens=4,
                settings_version=1,
                num_spec_steps=drafted[0],
                num_draft_tokens=sum(drafted),
                num_accepted_tokens=sum(accepted),
                drafted_per_position=drafted,
                accepted_per_position=accepted,
                batch_size_mean=3.5,
                batch_size_max=8,
                finish_reason="length",
            )
        )
    return out
