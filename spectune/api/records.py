"""Read endpoints: request records, acceptance and latency statistics,
tuner decisions, diagnostics reports and alerts."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, status
from pydantic import BaseModel, Field
from sqlalchemy import Engine, and_, func, or_, select

from spectune.store.aggregates import acceptance_by_class, latency_by_class
from spectune.store.models import AlertEvent, DiagnosticsReport, RequestRecordRow, StepStat, TunerDecision
from spectune.store.retention import left_out

from .auth import ERRORS, MAX_ID, ErrorOut, Offset, Operator, Principal, Role, Viewer
from .deps import Database, Diagnosis, Policies, known_class

router = APIRouter(
    prefix="/api/v1", tags=["records"], responses={**ERRORS, 400: {"model": ErrorOut, "description": "Bad cursor"}}
)

Limit = Annotated[int, Query(ge=1, le=1000)]
Window = Annotated[float, Query(gt=0, le=30 * 86_400, description="Look-back window in seconds")]


def _encode_cursor(row: Any) -> str:
    return base64.urlsafe_b64encode(f"{row.finish_time.isoformat()}|{row.request_id}".encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        when, request_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        return datetime.fromisoformat(when), request_id
    except (ValueError, UnicodeDecodeError):
        detail = [{"loc": ["query", "cursor"], "msg": "not a cursor this API returned", "type": "value_error"}]
        raise HTTPException(422, detail) from None


@router.get("/records")
def list_records(
    db: Database,
    policies: Policies,
    _: Viewer,
    limit: Limit = 100,
    cursor: str | None = None,
    instance: str | None = None,
    prompt_class: Annotated[str | None, Query(alias="class")] = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, Any]:
    """Newest first; pass ``next_cursor`` back as ``cursor`` for the next page."""
    known_class(policies, prompt_class)
    T = RequestRecordRow
    query = select(T.__table__).order_by(T.finish_time.desc(), T.request_id.desc()).limit(limit)
    if instance:
        query = query.where(T.instance_id == instance)
    if prompt_class:
        query = query.where(T.prompt_class == prompt_class)
    if since:
        query = query.where(T.finish_time >= _aware(since))
    if until:
        query = query.where(T.finish_time < _aware(until))
    if cursor:
        when, rid = _decode_cursor(cursor)
        query = query.where(or_(T.finish_time < when, and_(T.finish_time == when, T.request_id < rid)))
    with db.connect() as conn:
        rows = conn.execute(query).all()
    items = [dict(r._mapping) for r in rows]
    return {"items": items, "next_cursor": _encode_cursor(rows[-1]) if len(rows) == limit else None}


@router.get("/records/{request_id}", responses={404: {"model": ErrorOut, "description": "No such record"}})
def get_record(db: Database, _: Viewer, request_id: Annotated[str, Path(max_length=128)]) -> dict[str, Any]:
    """One record by id: the ``id`` of the OpenAI response it served (a completions request
    with several prompts has one record per prompt, ``<id>-<prompt index>``)."""
    T = RequestRecordRow
    with db.connect() as conn:
        row = conn.execute(select(T.__table__).where(T.request_id == request_id)).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no record {request_id!r}")
    return dict(row._mapping)


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


class AcceptanceGroup(StrEnum):
    CLASS = "class"
    POSITION = "position"
    BATCH = "batch_bucket"


@router.get("/stats/acceptance")
def acceptance(
    db: Database,
    _: Viewer,
    window_s: Window = 300.0,
    instance: str | None = None,
    group_by: AcceptanceGroup = AcceptanceGroup.CLASS,
) -> dict[str, Any]:
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    if group_by == AcceptanceGroup.BATCH:
        S = StepStat
        query = select(
            S.batch_bucket,
            S.num_speculative_tokens,
            func.sum(S.steps),
            func.sum(S.num_draft_tokens),
            func.sum(S.num_accepted_tokens),
        ).where(S.minute >= since.replace(second=0, microsecond=0))
        if instance:
            query = query.where(S.instance_id == instance)
        with db.connect() as conn:
            rows = conn.execute(query.group_by(S.batch_bucket, S.num_speculative_tokens)).all()
        return {
            "window_s": window_s,
            "group_by": group_by,
            "groups": [
                {
                    "batch_bucket": b,
                    "n": n,
                    "steps": steps,
                    "drafted": d,
                    "accepted": a,
                    "acceptance": a / d if d else None,
                }
                for b, n, steps, d, a in rows
            ],
        }
    groups = []
    for cls, g in sorted(acceptance_by_class(db, since, instance=instance).items()):
        item = {
            "class": cls,
            "requests": g.requests,
            "drafted": g.drafted,
            "accepted": g.accepted,
            "acceptance": g.accepted / g.drafted if g.drafted else None,
        }
        if group_by == AcceptanceGroup.POSITION:
            item["positions"] = [
                {"position": i, "drafted": d, "accepted": a, "acceptance": a / d if d else None}
                for i, (d, a) in enumerate(zip(g.drafted_per_position, g.accepted_per_position, strict=True))
            ]
        groups.append(item)
    return {"window_s": window_s, "group_by": group_by, "groups": groups, "left_out": left_out(db, since)}


@router.get("/stats/latency")
def latency(
    db: Database,
    policies: Policies,
    _: Viewer,
    window_s: Window = 300.0,
    instance: str | None = None,
    prompt_class: Annotated[str | None, Query(alias="class")] = None,
) -> dict[str, Any]:
    known_class(policies, prompt_class)
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    out = []
    for cls, entry in sorted(latency_by_class(db, since, None, instance, prompt_class).items()):
        tokens = entry.pop("output_tokens")
        out.append({"class": cls, **entry, "output_tokens_per_s": tokens / window_s})
    return {"window_s": window_s, "classes": out, "left_out": left_out(db, since, raw_only=True)}


def _rows(db: Engine, model: Any, order: Any, limit: int, offset: int) -> list[dict[str, Any]]:
    with db.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(select(model.__table__).order_by(order.desc()).limit(limit).offset(offset)).all()
        ]


@router.get("/decisions")
def decisions(db: Database, _: Viewer, limit: Limit = 100, offset: Offset = 0) -> list[dict[str, Any]]:
    return _rows(db, TunerDecision, TunerDecision.at, limit, offset)


def _redacted(report: dict[str, Any], who: Principal) -> dict[str, Any]:
    """Disagreement contexts are fragments of sampled prompts: operators only."""
    body = report.get("report")
    if who.role == Role.OPERATOR or not isinstance(body, dict) or not body.get("top_disagreements"):
        return report
    hidden = [{**d, "context": None} for d in body["top_disagreements"]]
    return {**report, "report": {**body, "top_disagreements": hidden, "contexts": "operator role required"}}


@router.get("/diagnostics")
def diagnostics(db: Database, who: Viewer, limit: Limit = 100, offset: Offset = 0) -> list[dict[str, Any]]:
    return [_redacted(r, who) for r in _rows(db, DiagnosticsReport, DiagnosticsReport.created_at, limit, offset)]


class DiagnosisRequest(BaseModel):
    model_config = {"extra": "forbid"}

    prompt_class: str | None = Field(default=None, alias="class")
    max_prompts: int = Field(default=8, ge=1, le=64)


@router.post(
    "/diagnostics",
    status_code=status.HTTP_202_ACCEPTED,
    responses={409: {"model": ErrorOut, "description": "No draft model to diagnose here"}},
)
def trigger_diagnosis(runner: Diagnosis, policies: Policies, body: DiagnosisRequest, _: Operator) -> dict[str, Any]:
    """Start a draft diagnosis in the background; poll GET /diagnostics/{id}."""
    if runner is None:
        raise HTTPException(status.HTTP_409_CONFLICT, "no draft model is configured on this instance to diagnose")
    known_class(policies, body.prompt_class)
    report_id, _future = runner.submit("api", body.prompt_class, body.max_prompts)
    return {"id": report_id, "status": "running"}


@router.get("/diagnostics/{report_id}")
def diagnostic(db: Database, report_id: Annotated[int, Path(ge=1, le=MAX_ID)], who: Viewer) -> dict[str, Any]:
    with db.connect() as conn:
        row = conn.execute(select(DiagnosticsReport.__table__).where(DiagnosticsReport.id == report_id)).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no diagnostics report {report_id}")
    return _redacted(dict(row._mapping), who)


@router.get("/alerts")
def alerts(db: Database, _: Viewer, limit: Limit = 100, offset: Offset = 0) -> list[dict[str, Any]]:
    return _rows(db, AlertEvent, AlertEvent.received_at, limit, offset)
