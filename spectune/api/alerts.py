"""Alertmanager webhook receiver: alert notifications become alert events.

Alertmanager re-sends a group's notification on every repeat interval; an
alert is stored once per (fingerprint, status, startsAt) -- a unique key, so
repeats (also concurrent ones) are idempotent.  A newly firing alert starts a draft diagnosis (for its
``class`` label, if any) and is linked to it -- unless it is labelled
``diagnose: "false"`` (the store's own alerts: not the draft's doing).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import update

from spectune.store.db import conflict_insert
from spectune.store.models import AlertEvent

from .auth import ERRORS, Operator
from .deps import Database, Diagnosis, Policies

router = APIRouter(prefix="/api/v1", tags=["alerts"], responses=ERRORS)


class AlertIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str = Field(pattern="^(firing|resolved)$")
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: datetime
    endsAt: datetime | None = None
    fingerprint: str = Field(min_length=1, max_length=64)


class WebhookIn(BaseModel):
    """Alertmanager's webhook payload (version 4)."""

    model_config = ConfigDict(extra="allow")

    version: str = "4"
    status: str = Field(pattern="^(firing|resolved)$")
    receiver: str = ""
    alerts: list[AlertIn] = Field(max_length=1000)


def _insert_new(conn: Any) -> Any:
    notification = ["fingerprint", "status", "starts_at"]
    return conflict_insert(conn, AlertEvent).on_conflict_do_nothing(index_elements=notification)


@router.post("/alerts/alertmanager")
def alertmanager_webhook(
    db: Database, policies: Policies, runner: Diagnosis, payload: WebhookIn, _: Operator
) -> dict[str, Any]:
    stored, firing = 0, []
    now = datetime.now(UTC)
    with db.begin() as conn:
        for alert in payload.alerts:
            starts = alert.startsAt if alert.startsAt.tzinfo else alert.startsAt.replace(tzinfo=UTC)
            row = dict(
                fingerprint=alert.fingerprint,
                status=alert.status,
                alertname=alert.labels.get("alertname", "")[:128],
                labels={**alert.labels, **{f"annotation:{k}": v for k, v in alert.annotations.items()}},
                starts_at=starts,
                received_at=now,
            )
            # The unique notification key makes a concurrent repeat a no-op, not a second event.
            event_id = conn.execute(_insert_new(conn).values(**row).returning(AlertEvent.id)).scalar()
            if event_id is None:
                continue
            stored += 1
            if alert.status == "firing" and alert.labels.get("diagnose") != "false":
                firing.append((event_id, alert.labels.get("class")))
    classes = policies.known_classes() if firing and runner is not None else set()
    for event_id, prompt_class in firing if runner is not None else ():
        known = prompt_class if prompt_class in classes else None
        report_id, _ = runner.submit("alert", known)
        with db.begin() as conn:
            conn.execute(update(AlertEvent).where(AlertEvent.id == event_id).values(diagnosis_id=report_id))
    return {"received": len(payload.alerts), "stored": stored}
