"""What the fidelity audit found (``fidelity_checks``, written by the recorder)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Engine, func, select

from .models import FidelityCheck

RESULTS = ("match", "near_tie", "defect")


def fidelity_summary(db: Engine, since: datetime, prompt_class: str | None = None) -> list[dict[str, Any]]:
    """Per class and method since ``since``: audited requests, how many diverged, how many of those
    were near-ties and how many defects, and the largest margin among the near-ties."""
    t = FidelityCheck.__table__
    query = (
        select(
            t.c.prompt_class,
            t.c.speculation_method,
            t.c.result,
            func.count().label("checks"),
            func.max(func.coalesce(t.c.plain_margin, t.c.served_margin)).label("max_margin"),
        )
        .where(t.c.checked_at >= since)
        .group_by(t.c.prompt_class, t.c.speculation_method, t.c.result)
    )
    if prompt_class is not None:
        query = query.where(t.c.prompt_class == prompt_class)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    with db.connect() as conn:
        for row in conn.execute(query):
            entry = out.setdefault(
                (row.prompt_class, row.speculation_method),
                {"class": row.prompt_class, "method": row.speculation_method, **dict.fromkeys(RESULTS, 0)},
            )
            entry[row.result] = row.checks
            if row.result == "near_tie":
                entry["max_near_tie_margin"] = row.max_margin
    for entry in out.values():
        audited = sum(entry[r] for r in RESULTS)
        entry["audited"] = audited
        entry["divergence_rate"] = (entry["near_tie"] + entry["defect"]) / audited if audited else None
    return sorted(out.values(), key=lambda e: (e["class"], e["method"]))


def recent_divergences(
    db: Engine, since: datetime, limit: int, result: str | None = None, prompt_class: str | None = None
) -> list[dict[str, Any]]:
    """Newest first: the checks that did not match (``result`` narrows to near_tie or defect)."""
    t = FidelityCheck.__table__
    query = select(t).where(t.c.checked_at >= since, t.c.result != "match")
    if prompt_class is not None:
        query = query.where(t.c.prompt_class == prompt_class)
    if result is not None:
        query = query.where(t.c.result == result)
    with db.connect() as conn:
        rows = conn.execute(query.order_by(t.c.checked_at.desc()).limit(limit))
        return [{**row._mapping, "checked_at": row.checked_at.isoformat()} for row in rows]
