"""Policy routes: read, replace, patch, history, diff, rollback, audit.

Optimistic concurrency: every read returns ``ETag: "<version>"``; every
write needs ``If-Match`` with the version it is based on (428 without it,
400 for anything but one strong version ETag, 409 when it is stale).
``X-Change-Reason`` goes into the audit trail.  Every write goes through the
``PolicyService`` (validation, the versioned write, the engine holding it
when the response is sent); its database work runs in the thread pool, so a
hung database never stalls the event loop that serves ``/v1``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, HTTPException, Path, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field, ValidationError

from spectune.control.service import PolicyService
from spectune.store.policies import StaleVersionError, Versioned, json_diff
from spectune.tuner.policy import Policy, PolicyDocument, effective_policy, runtime_settings

from .auth import ERRORS, MAX_ID, ErrorOut, Offset, Operator, Viewer
from .deps import Policies

router = APIRouter(prefix="/api/v1", tags=["policy"], responses=ERRORS)
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {
        "model": ErrorOut,
        "description": "Stale If-Match: the policy changed meanwhile (ETag has the current version)",
    },
    400: {"model": ErrorOut, "description": "Malformed If-Match"},
    428: {"model": ErrorOut, "description": "If-Match missing"},
}
IfMatch = Annotated[
    str,  # optional (the handlers default it to None, answered 428); `str | None` would document a null header
    # The pattern documents the form (checked by _expected, which answers 400 rather than FastAPI's 422).
    Header(
        description='The version this write is based on, as returned in ETag, e.g. "3"',
        json_schema_extra={"pattern": '^"[0-9]{1,9}"$'},
    ),
]
VersionNumber = Annotated[int, Path(ge=1, le=MAX_ID)]
Reason = Annotated[str | None, Header(max_length=500, description="Why; recorded in the audit trail")]


class PolicyVersionOut(BaseModel):
    version: int
    updated_at: str
    updated_by: str
    policy: dict[str, Any]


class RollbackIn(BaseModel):
    model_config = {"extra": "forbid"}
    version: int = Field(ge=1, le=MAX_ID)


def _out(v: Versioned) -> PolicyVersionOut:
    return PolicyVersionOut(version=v.version, updated_at=v.at.isoformat(), updated_by=v.by, policy=v.body)


def _etag(version: int) -> str:
    return f'"{version}"'


def _expected(if_match: str | None) -> int:
    """The version a write is based on; If-Match compares strongly (RFC 9110), so a weak ETag never matches."""
    if if_match is None:
        raise HTTPException(
            status.HTTP_428_PRECONDITION_REQUIRED, 'If-Match required: the ETag of the policy read, e.g. "3"'
        )
    value = if_match.strip()
    if len(value) >= 3 and value[0] == value[-1] == '"' and value[1:-1].isdigit() and value[1:-1].isascii():
        version = int(value[1:-1])
        if version <= MAX_ID:  # beyond it no version ever existed
            return version
    raise HTTPException(
        status.HTTP_400_BAD_REQUEST, f'If-Match must be one strong version ETag like "3", got {if_match!r}'
    )


def _validated(policies: PolicyService, body: dict[str, Any]) -> PolicyDocument:
    try:
        return policies.validated(body)
    except ValidationError as exc:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_ENTITY,
            [
                {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                for e in exc.errors(include_url=False, include_context=False)
            ],
        ) from None
    except ValueError as exc:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_ENTITY, [{"loc": ["policy"], "msg": str(exc), "type": "value_error"}]
        ) from None


async def _write(
    policies: PolicyService,
    response: Response,
    doc: PolicyDocument,
    expected: int,
    who: str,
    reason: str | None,
    action: str,
) -> PolicyVersionOut:
    try:
        written = await policies.write(doc, expected, who, reason, action)
    except StaleVersionError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc), headers={"ETag": _etag(exc.current)}) from None
    response.headers["ETag"] = _etag(written.version)
    return _out(written)


@router.get("/policy", response_model=PolicyVersionOut)
def get_policy(policies: Policies, response: Response, _: Viewer) -> PolicyVersionOut:
    current = policies.current()
    response.headers["ETag"] = _etag(current.version)
    return _out(current)


@router.put("/policy", response_model=PolicyVersionOut, responses=WRITE_ERRORS)
async def replace_policy(
    policies: Policies,
    response: Response,
    who: Operator,
    body: PolicyDocument,
    if_match: IfMatch = None,
    x_change_reason: Reason = None,
) -> PolicyVersionOut:
    expected = _expected(if_match)
    return await _write(
        policies, response, _validated(policies, body.body()), expected, who.name, x_change_reason, "replace"
    )


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


@router.patch("/policy", response_model=PolicyVersionOut, responses=WRITE_ERRORS)
async def patch_policy(
    policies: Policies,
    response: Response,
    who: Operator,
    patch: Annotated[dict[str, Any], Body(description="JSON merge patch (RFC 7386) on the policy document")],
    if_match: IfMatch = None,
    x_change_reason: Reason = None,
) -> PolicyVersionOut:
    expected = _expected(if_match)
    current = await run_in_threadpool(policies.current)
    doc = _validated(policies, merge_patch(current.body, patch))
    return await _write(policies, response, doc, expected, who.name, x_change_reason, "patch")


@router.get("/policy/versions", response_model=list[PolicyVersionOut])
def list_versions(
    policies: Policies, _: Viewer, limit: Annotated[int, Query(ge=1, le=500)] = 50, offset: Offset = 0
) -> list[PolicyVersionOut]:
    return [_out(v) for v in policies.repository.versions(limit, offset)]


def _version(policies: PolicyService, number: int) -> Versioned:
    found = policies.repository.version(number)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no policy version {number}")
    return found


@router.get("/policy/versions/{number}", response_model=PolicyVersionOut)
def get_version(policies: Policies, number: VersionNumber, _: Viewer) -> PolicyVersionOut:
    return _out(_version(policies, number))


@router.get("/policy/diff")
def diff_versions(
    policies: Policies,
    _: Viewer,
    from_: Annotated[int, Query(alias="from", ge=1, le=MAX_ID)],
    to: Annotated[int, Query(ge=1, le=MAX_ID)],
) -> dict[str, Any]:
    return {"from": from_, "to": to, "changes": json_diff(_version(policies, from_).body, _version(policies, to).body)}


@router.post("/policy/rollback", response_model=PolicyVersionOut, responses=WRITE_ERRORS)
async def rollback(
    policies: Policies,
    response: Response,
    who: Operator,
    body: RollbackIn,
    if_match: IfMatch = None,
    x_change_reason: Reason = None,
) -> PolicyVersionOut:
    expected = _expected(if_match)
    target = await run_in_threadpool(_version, policies, body.version)
    doc = _validated(policies, target.body)
    reason = x_change_reason or f"rollback to version {body.version}"
    return await _write(policies, response, doc, expected, who.name, reason, "rollback")


@router.get("/policy/effective", response_model=Policy)
def effective(
    policies: Policies,
    _: Viewer,
    instance: str | None = None,
    prompt_class: Annotated[str | None, Query(alias="class")] = None,
) -> Policy:
    doc = policies.document()
    if prompt_class is not None and prompt_class not in policies.known_classes(doc):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown prompt class {prompt_class!r}")
    return effective_policy(doc, instance, prompt_class)


@router.get("/engines/{instance}/settings", responses={304: {"description": "Unchanged since If-None-Match"}})
def engine_settings(
    policies: Policies,
    response: Response,
    instance: str,
    _: Viewer,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Any:
    """What a (remote) engine instance should run; poll with If-None-Match."""
    current = policies.current()
    etag = _etag(current.version)
    if if_none_match == etag:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
    response.headers["ETag"] = etag
    doc = policies.document(current)
    return runtime_settings(doc, instance, set(policies.startup_classes), current.version).model_dump(mode="json")


@router.get("/audit")
def audit(
    policies: Policies, _: Viewer, limit: Annotated[int, Query(ge=1, le=500)] = 50, offset: Offset = 0
) -> list[dict[str, Any]]:
    return [
        {"id": a.id, "at": a.at.isoformat(), "actor": a.actor, "action": a.action, "reason": a.reason, "diff": a.diff}
        for a in policies.repository.audit(limit, offset)
    ]
