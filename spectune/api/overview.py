"""What the operator dashboard needs at a glance: who am I, what runs per
class now, and acceptance / throughput over time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import select

from spectune.store.models import RequestRecordRow
from spectune.tuner.policy import PolicyDocument, effective_policy

from .auth import ERRORS, Viewer
from .records import Window

router = APIRouter(prefix="/api/v1", tags=["overview"], responses=ERRORS)


@router.get("/whoami")
def whoami(principal: Viewer) -> dict[str, str]:
    return {"name": principal.name, "role": principal.role.value}


@router.get("/classes")
def classes(request: Request, _: Viewer) -> dict[str, Any]:
    """Every known prompt class with the policy in force for it (global <- class override)."""
    current = request.app.state.policies.current()
    doc = PolicyDocument.model_validate(current.body) if current else PolicyDocument()
    out = []
    for cls in sorted(request.app.state.known_classes):
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
    request: Request,
    _: Viewer,
    window_s: Window = 3600.0,
    bucket_s: Annotated[float, Query(ge=1, le=86_400, description="Width of one point in seconds")] = 60.0,
) -> dict[str, Any]:
    """Per class and time bucket: requests, acceptance (accepted / drafted), output tokens/s."""
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    T = RequestRecordRow
    query = (
        select(T.prompt_class, T.finish_time, T.num_draft_tokens, T.num_accepted_tokens, T.output_tokens)
        .where(T.finish_time >= since)
        .limit(500_000)
    )
    with request.app.state.db.connect() as conn:
        rows = conn.execute(query).all()
    points: dict[tuple[str, float], list[int]] = {}
    for cls, finished, drafted, accepted, tokens in rows:
        at = finished if finished.tzinfo else finished.replace(tzinfo=UTC)
        start = at.timestamp() // bucket_s * bucket_s
        p = points.setdefault((cls, start), [0, 0, 0, 0])
        p[0] += 1
        p[1] += drafted
        p[2] += accepted
        p[3] += tokens
    return {
        "window_s": window_s,
        "bucket_s": bucket_s,
        "points": [
            {
                "class": cls,
                "time": datetime.fromtimestamp(start, UTC).isoformat(),
                "requests": n,
                "acceptance": a / d if d else None,
                "output_tokens_per_s": tokens / bucket_s,
            }
            for (cls, start), (n, d, a, tokens) in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ],
    }
