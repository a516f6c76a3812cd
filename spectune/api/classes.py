"""The prompt classes in force: the policy's classifier where it has one, else the engines' start-up classes."""

from __future__ import annotations

from fastapi import Request

from spectune.tuner.policy import PolicyDocument


def known_classes(request: Request, doc: PolicyDocument | None = None) -> set[str]:
    """``doc``: the policy document already read by the caller (else the current one is read)."""
    startup = request.app.state.startup_classes
    if doc is None:
        current = request.app.state.policies.current()
        doc = PolicyDocument.model_validate(current.body) if current is not None else PolicyDocument()
    return doc.known_classes(startup)
