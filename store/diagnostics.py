"""Diagnostics reports: a row per diagnosis, from 'running' to 'done' or 'failed'."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert, select, update

from .models import DiagnosticsReport, SampledPrompt
from .tuner_inputs import acceptance_counts


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
    return {
        cls: [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
        for cls, (drafted, accepted) in acceptance_counts(db, datetime.now(UTC) - window).items()
    }
