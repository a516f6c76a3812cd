"""Diagnostics reports: a row per diagnosis, from 'running' to 'done' or 'failed'."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert, select, update

from .models import DiagnosticsReport, RequestRecordRow, SampledPrompt


def start_report(db: Engine, trigger: str, prompt_class: str | None) -> int:
    with db.begin() as conn:
        return conn.execute(
            insert(DiagnosticsReport).values(
                created_at=datetime.now(UTC), trigger=trigger, prompt_class=prompt_class, status="running"
            )
        ).inserted_primary_key[0]


def finish_report(db: Engine, report_id: int, report: dict[str, Any], summary: str) -> None:
    with db.begin() as conn:
        conn.execute(
            update(DiagnosticsReport)
            .where(DiagnosticsReport.id == report_id)
            .values(status="done", finished_at=datetime.now(UTC), report=report, summary=summary)
        )


def fail_report(db: Engine, report_id: int, error: str) -> None:
    with db.begin() as conn:
        conn.execute(
            update(DiagnosticsReport)
            .where(DiagnosticsReport.id == report_id)
            .values(status="failed", finished_at=datetime.now(UTC), error=error[:4000])
        )


def sampled_prompts(db: Engine, prompt_class: str | None, limit: int) -> list[tuple[str, str]]:
    """Recent opt-in sampled prompts (class, text), newest first."""
    query = select(SampledPrompt.prompt_class, SampledPrompt.prompt).where(SampledPrompt.expires_at > datetime.now(UTC))
    if prompt_class:
        query = query.where(SampledPrompt.prompt_class == prompt_class)
    with db.connect() as conn:
        return [
            (r.prompt_class, r.prompt)
            for r in conn.execute(query.order_by(SampledPrompt.created_at.desc()).limit(limit))
        ]


def realised_per_position(db: Engine, window: timedelta) -> dict[str, list[float]]:
    """accepted / drafted per draft position and class over the window, from the records."""
    since = datetime.now(UTC) - window
    sums: dict[str, tuple[list[int], list[int]]] = {}
    with db.connect() as conn:
        rows = conn.execute(
            select(
                RequestRecordRow.prompt_class,
                RequestRecordRow.drafted_per_position,
                RequestRecordRow.accepted_per_position,
            ).where(RequestRecordRow.finish_time >= since)
        )
        for cls, drafted, accepted in rows:
            d, a = sums.setdefault(cls, ([], []))
            for target, values in ((d, drafted), (a, accepted)):
                target += [0] * (len(values) - len(target))
                for i, v in enumerate(values):
                    target[i] += v
    return {cls: [x / y if y else 0.0 for x, y in zip(a, d)] for cls, (d, a) in sums.items() if any(d)}
