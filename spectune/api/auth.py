"""Bearer-token auth with three roles: viewer (reads), operator (writes), engine (a remote engine:
reads, and the fleet's rebuild slot).

Tokens come from settings (``SPECTUNE_API_TOKENS``, JSON:
``{"alice": {"token": "...", "role": "operator"}}``).  Comparison is
constant-time and covers every configured token, so timing tells nothing
about which one nearly matched; tokens are never logged.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, SecretStr

from . import deps


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ENGINE = "engine"  # a remote engine's token: reads its settings, takes and gives back the rebuild slot


class TokenSpec(BaseModel):
    token: SecretStr
    role: Role


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role


_bearer = HTTPBearer(auto_error=False, description="spectune API token")


def authenticate(tokens: dict[str, TokenSpec], presented: str) -> Principal | None:
    found = None
    for name, spec in tokens.items():
        if hmac.compare_digest(spec.token.get_secret_value().encode(), presented.encode()):
            found = Principal(name, spec.role)
    return found


def principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "missing bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    found = authenticate(deps.services(request).api_tokens, credentials.credentials)
    if found is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid token", headers={"WWW-Authenticate": "Bearer"})
    return found


def viewer(p: Annotated[Principal, Depends(principal)]) -> Principal:
    return p


def requiring(*roles: Role) -> Any:
    """A dependency admitting only tokens of ``roles`` (403 naming them otherwise)."""
    required = " or ".join(roles) + " role required"

    def check(p: Annotated[Principal, Depends(principal)]) -> Principal:
        if p.role not in roles:
            raise HTTPException(status.HTTP_403_FORBIDDEN, required)
        return p

    return check


class ErrorOut(BaseModel):
    detail: Any


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "Missing or invalid bearer token"},
    403: {"model": ErrorOut, "description": "The token's role may not do this (operator, or engine, required)"},
    404: {"model": ErrorOut, "description": "Not found"},
    422: {"model": ErrorOut, "description": "Invalid input; the message names the field"},
}

# Page offsets stay within a 64-bit integer (SQLite refuses larger ones).
Offset = Annotated[int, Query(ge=0, le=1_000_000_000)]
# Ids and versions are PostgreSQL INTEGERs: a larger number names nothing (and would overflow).
MAX_ID = 2**31 - 1

Viewer = Annotated[Principal, Depends(viewer)]
Operator = Annotated[Principal, Depends(requiring(Role.OPERATOR))]
EngineOrOperator = Annotated[Principal, Depends(requiring(Role.ENGINE, Role.OPERATOR))]
