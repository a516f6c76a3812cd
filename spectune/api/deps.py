"""What routes depend on, typed (the FastAPI full-stack template's ``deps.py``).

``create_app`` builds one ``Services`` per application; routes name the part they need
(``Database``, ``Policies``, ``Diagnosis``; the bearer check its tokens) and never read the application's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy import Engine

from spectune.control.service import PolicyService
from spectune.tuner.diagnosis_job import DiagnosisRunner

if TYPE_CHECKING:
    from .auth import TokenSpec  # auth's bearer check reads the tokens through services()


@dataclass(frozen=True)
class Services:
    db: Engine
    policies: PolicyService
    api_tokens: dict[str, TokenSpec]
    diagnosis: DiagnosisRunner | None = None


def services(request: Request) -> Services:
    return request.app.state.services  # the one read of the application's state


async def _db(request: Request) -> Engine:
    return services(request).db


async def _policies(request: Request) -> PolicyService:
    return services(request).policies


async def _diagnosis(request: Request) -> DiagnosisRunner | None:
    return services(request).diagnosis


Database = Annotated[Engine, Depends(_db)]
Policies = Annotated[PolicyService, Depends(_policies)]
Diagnosis = Annotated[DiagnosisRunner | None, Depends(_diagnosis)]


def known_class(policies: PolicyService, prompt_class: str | None) -> None:
    """404 for a class neither the classifier in force nor the start-up one has (records of either may be stored)."""
    if prompt_class is not None and prompt_class not in policies.known_classes() | policies.startup_classes:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown prompt class {prompt_class!r}")
