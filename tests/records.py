"""Synthetic RequestRecords for store tests (engine-free)."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from spectune.engine.schema import RequestRecord
from spectune.store.models import RequestSum, RequestSumPosition

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)
TOTALS = ("requests", "drafting_requests", "errors", "output_tokens", "num_spec_steps", "num_draft_tokens",
          "num_accepted_tokens")  # fmt: skip


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


def spread_records(records, seed: int = 0):
    """Records over two hours before NOW, three instances, some that drafted nothing."""
    out = []
    for i, r in enumerate(records):
        update = {"finish_time": (NOW - timedelta(seconds=(i * 37 + seed) % 7200)).timestamp(),
                  "instance_id": "abc"[i % 3]}  # fmt: skip
        if i % 7 == 0:
            update |= {"num_draft_tokens": 0, "num_accepted_tokens": 0, "drafted_per_position": [],
                       "accepted_per_position": []}  # fmt: skip
        out.append(r.model_copy(update=update))
    return out


def stored_sums(db) -> tuple[dict, dict]:
    """The sums tables as {(width, start, instance, class, N): [TOTALS...]} and
    {(width, start, instance, class, N, position): [drafted, accepted]}."""
    with db.connect() as conn:
        sums = conn.execute(sa.select(RequestSum.__table__)).all()
        positions = conn.execute(sa.select(RequestSumPosition.__table__)).all()
    return (
        {(m.width_s, m.start, m.instance_id, m.prompt_class, m.num_speculative_tokens): [getattr(m, c) for c in TOTALS]
         for m in sums},
        {(p.width_s, p.start, p.instance_id, p.prompt_class, p.num_speculative_tokens, p.position):
         [p.drafted, p.accepted] for p in positions},
    )  # fmt: skip
