"""What the operator dashboard needs at a glance: who am I, what runs per
class now, and acceptance / throughput over time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query

from spectune.store.aggregates import timeseries_by_class
from spectune.store.retention import left_out
from spectune.tuner.policy import PolicyDocument, effective_policy

from .auth import ERRORS, Viewer
from .deps import Database, Policies
from .records import Window

router = APIRouter(prefix="/api/v1", tags=["overview"], responses=ERRORS)


@router.get("/whoami")
def whoami(principal: Viewer) -> dict[str, str]:
    return {"name": principal.name, "role": principal.role.value}


@router.get("/classes")
def classes(policies: Policies, _: Viewer) -> dict[str, Any]:
    """Every known prompt class with the policy in force for it (global <- class override)."""
    current = policies.repository.current()
    doc = policies.document(current) if current else PolicyDocument()
    out = []
    for cls in sorted(policies.known_classes(doc)):
        p = effective_policy(doc, None, cls)
        out.append(
            {
                "class": cls,
                "speculation_enabled": p.speculation_enabled,
                "num_speculative_tokens": p.num_speculative_tokens if p.speculation_enabled else 0,
                "batch_table": [e.model_dump() for e in p.batch_table],
                "tuner_mode": p.tuner_mode.value,
            }
        )
    return {"policy_version": current.version if current else None, "classes": out}


@router.get("/stats/timeseries")
def timeseries(
    db: Database,
    _: Viewer,
    window_s: Window = 3600.0,
    bucket_s: Annotated[float, Query(ge=1, le=86_400, description="Width of one point in seconds")] = 60.0,
) -> dict[str, Any]:
    """Per class and time bucket: requests, acceptance (accepted / drafted), output tokens/s."""
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    rows = timeseries_by_class(db, since, bucket_s)
    return {
        "window_s": window_s,
        "bucket_s": bucket_s,
        # widths of whole minutes read the sums; others read only records, all of them gone before the horizon
        "left_out": left_out(db, since, raw_only=round(bucket_s * 1e6) % 60_000_000 != 0),
        "points": [
            {
                "class": cls,
                "time": datetime.fromtimestamp(start, UTC).isoformat(),
                "requests": n,
                "acceptance": a / d if d else None,
                "output_tokens_per_s": tokens / bucket_s,
            }
            for cls, start, n, d, a, tokens in rows
        ],
    }
