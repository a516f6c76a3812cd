"""The fleet: which instance holds which settings version, and the rebuild slot for rolling changes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Response, status
from fastapi.concurrency import run_in_threadpool

from spectune.store import rebuilds
from spectune.store.instances import fleet

from .auth import ERRORS, EngineOrOperator, Viewer
from .deps import Database, Policies

router = APIRouter(prefix="/api/v1", tags=["fleet"], responses=ERRORS)
InstanceId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[!-~]+$", description="printable ASCII")]


@router.get("/instances")
def instances(db: Database, policies: Policies, _: Viewer) -> dict[str, Any]:
    """Every engine instance: what it serves, the settings version it holds, and whether it is a
    straggler (live but behind the policy 30 s after a change) or stale (no heartbeat for 60 s)."""
    current = policies.repository.current()
    version, at = (current.version, current.at) if current else (None, None)
    rows = fleet(db, version, at)
    for row in rows:
        for key in ("started_at", "last_seen_at"):
            row[key] = row[key].isoformat()
    slot = rebuilds.current(db)
    return {
        "policy_version": version,
        "instances": rows,
        "behind": [r["instance_id"] for r in rows if r["behind"]],
        "rebuilding": slot.holder,
    }


@router.post(
    "/engines/{instance}/rebuild-slot",
    responses={409: {"description": "Another instance holds the slot (it names it)"}},
)
async def take_rebuild_slot(db: Database, instance: InstanceId, _: EngineOrOperator) -> dict[str, Any]:
    """An engine that must rebuild (method or drafter change) takes the fleet's one slot first, so at
    most one instance is paused at a time; it gives it back when it serves again (or it expires)."""
    granted, slot = await run_in_threadpool(rebuilds.acquire, db, instance)
    if not granted:
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"instance {slot.holder!r} is rebuilding (slot until {slot.expires_at})"
        )
    return {"holder": slot.holder, "expires_at": slot.expires_at.isoformat()}


@router.delete("/engines/{instance}/rebuild-slot", status_code=status.HTTP_204_NO_CONTENT)
async def give_back_rebuild_slot(db: Database, instance: InstanceId, _: EngineOrOperator) -> Response:
    await run_in_threadpool(rebuilds.release, db, instance)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
