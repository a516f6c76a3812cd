"""Test-only faults, to show that the checks catch what they claim to catch.

``SPECTUNE_TEST_FAULT=accept_unverified`` (read by ``SpecEngine`` at start) makes
vLLM's rejection sampler accept every draft token without verifying it -- the
losslessness defect the fidelity audit (``engine/fidelity.py``) must flag.
Nothing is installed unless the variable is set; never set it in production.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from .drafter import UnsupportedVllmError

ENV = "SPECTUNE_TEST_FAULT"
FAULTS = ("accept_unverified",)


def requested() -> str | None:
    fault = os.environ.get(ENV) or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"{ENV}={fault!r}: known faults are {', '.join(FAULTS)}")
    return fault


def install_in_worker(worker: Any = None) -> bool:
    """Replace ``rejection_sample`` (looked up by name in ``RejectionSampler.forward``) in this worker."""
    from vllm.v1.sample import rejection_sampler

    stock = getattr(rejection_sampler, "rejection_sample", None)
    if stock is None:
        raise UnsupportedVllmError("vllm.v1.sample.rejection_sampler has no rejection_sample() to fault")
    if getattr(stock, "spectune_fault", False):
        return True
    signature = inspect.signature(stock)
    needed = {"draft_token_ids", "num_draft_tokens", "bonus_token_ids"}
    if not needed <= set(signature.parameters):
        raise UnsupportedVllmError(f"rejection_sample{signature} lacks {sorted(needed - set(signature.parameters))}")

    def accept_unverified(*args: Any, **kwargs: Any) -> Any:
        out = stock(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        draft_token_ids, num_draft_tokens = given["draft_token_ids"], given["num_draft_tokens"]
        bonus = given["bonus_token_ids"]  # [batch, 1]: sampled after the last draft position
        start = 0
        for row, n in enumerate(num_draft_tokens):
            if n:
                out[row, :n] = draft_token_ids[start : start + n]
                out[row, n] = bonus[row, 0]
            start += n
        return out

    accept_unverified.spectune_fault = True  # type: ignore[attr-defined]
    rejection_sampler.rejection_sample = accept_unverified
    return True
