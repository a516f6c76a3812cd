"""The fidelity audit's findings: is speculation changing outputs?"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from spectune.store.fidelity import fidelity_summary, recent_divergences

from .auth import ERRORS, Viewer
from .deps import Database, Policies, known_class
from .records import Limit, Window

router = APIRouter(prefix="/api/v1", tags=["fidelity"], responses=ERRORS)


@router.get("/fidelity")
def fidelity(
    db: Database,
    policies: Policies,
    _: Viewer,
    window_s: Window = 86_400,
    prompt_class: Annotated[str | None, Query(alias="class")] = None,
    result: Literal["near_tie", "defect"] | None = None,
    limit: Limit = 50,
) -> dict[str, Any]:
    """Audited requests per class and method (match / near_tie / defect) and the latest divergences.

    A near-tie: the first differing token sat where the target's top-2 logprob margin was below the
    policy's ``fidelity_near_tie_nats`` in both runs (batch-shape numerics); a defect: above it, or a
    served token that was not the target's argmax in its own run."""
    known_class(policies, prompt_class)
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    return {
        "window_s": window_s,
        "classes": fidelity_summary(db, since, prompt_class),
        "divergences": recent_divergences(db, since, limit, result, prompt_class),
    }
