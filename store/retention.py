"""Retention: fold old request records into per-minute rollups, then delete them.

Runs as a scheduled job.  Each chunk is one transaction -- rollup upsert and
delete together -- so a crash never double-counts or loses a record.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, and_, delete, select, tuple_

from .models import RequestRecordRow, RequestRollup, SampledPrompt
from .steps import add_positions


def expire_prompts(db: Engine, now: datetime | None = None) -> int:
    """Delete sampled prompts past their expiry; returns how many."""
    with db.begin() as conn:
        return conn.execute(delete(SampledPrompt).where(SampledPrompt.expires_at < (now or datetime.now(UTC)))).rowcount


def roll_up(db: Engine, older_than: timedelta, now: datetime | None = None, chunk: int = 5000) -> int:
    """Roll up and delete records finished before ``now - older_than``; returns how many."""
    cutoff = (now or datetime.now(UTC)) - older_than
    total = 0
    while True:
        with db.begin() as conn:
            rows = (
                conn.execute(
                    select(RequestRecordRow.__table__)
                    .where(RequestRecordRow.finish_time < cutoff)
                    .order_by(RequestRecordRow.finish_time)
                    .limit(chunk)
                )
                .mappings()
                .all()
            )
            if not rows:
                return total
            groups: dict[tuple, dict] = defaultdict(
                lambda: dict(
                    requests=0,
                    errors=0,
                    output_tokens=0,
                    num_spec_steps=0,
                    num_draft_tokens=0,
                    num_accepted_tokens=0,
                    drafted_per_position=[],
                    accepted_per_position=[],
                    ttft_s_sum=0.0,
                    e2e_s_sum=0.0,
                )
            )
            for r in rows:
                minute = r["finish_time"].replace(second=0, microsecond=0)
                g = groups[(r["instance_id"], r["prompt_class"], r["num_speculative_tokens"], minute)]
                g["requests"] += 1
                g["errors"] += r["finish_reason"] == "error"
                for key in ("output_tokens", "num_spec_steps", "num_draft_tokens", "num_accepted_tokens"):
                    g[key] += r[key]
                add_positions(g["drafted_per_position"], r["drafted_per_position"])
                add_positions(g["accepted_per_position"], r["accepted_per_position"])
                g["ttft_s_sum"] += r["ttft_s"] or 0.0
                g["e2e_s_sum"] += r["e2e_s"]
            key_cols = (
                RequestRollup.instance_id,
                RequestRollup.prompt_class,
                RequestRollup.num_speculative_tokens,
                RequestRollup.minute,
            )
            existing = {
                (e.instance_id, e.prompt_class, e.num_speculative_tokens, e.minute): e
                for e in conn.execute(select(RequestRollup.__table__).where(tuple_(*key_cols).in_(list(groups)))).all()
            }
            for key, g in groups.items():
                old = existing.get(key)
                if old is None:
                    conn.execute(
                        RequestRollup.__table__.insert().values(
                            instance_id=key[0], prompt_class=key[1], num_speculative_tokens=key[2], minute=key[3], **g
                        )
                    )
                    continue
                merged = {k: getattr(old, k) + v for k, v in g.items() if not k.endswith("_position")}
                merged["drafted_per_position"] = add_positions(
                    list(old.drafted_per_position), g["drafted_per_position"]
                )
                merged["accepted_per_position"] = add_positions(
                    list(old.accepted_per_position), g["accepted_per_position"]
                )
                conn.execute(
                    RequestRollup.__table__.update()
                    .where(and_(*(c == v for c, v in zip(key_cols, key))))
                    .values(**merged)
                )
            conn.execute(
                delete(RequestRecordRow).where(RequestRecordRow.request_id.in_([r["request_id"] for r in rows]))
            )
            total += len(rows)
