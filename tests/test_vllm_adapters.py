"""The vLLM adapters refuse to start on a vLLM that lacks what they rely on (no engine needed)."""

from __future__ import annotations

import pytest
import vllm
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from spectune.engine import drafter


def test_pinned_vllm_passes():
    drafter.check_supported()


def test_other_vllm_version_is_refused(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv(drafter.ALLOW_UNTESTED, raising=False)
    with pytest.raises(drafter.UnsupportedVllmError, match=r"vLLM 0\.99\.0 is installed"):
        drafter.check_supported()
    monkeypatch.setenv(drafter.ALLOW_UNTESTED, "1")
    drafter.check_supported()  # opted out of the version pin; the internals still pass


def test_changed_propose_signature_is_refused(monkeypatch):
    def propose(self, target_token_ids, common_attn_metadata):  # K no longer first
        raise AssertionError("never called")

    monkeypatch.setattr(SpecDecodeBaseProposer, "propose", propose)
    with pytest.raises(drafter.UnsupportedVllmError, match="not the signature"):
        drafter.check_supported()


def test_a_changed_suffix_or_ngram_propose_is_refused(monkeypatch):
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    def propose(self, input_batch, sampled_token_ids):  # K no longer first
        raise AssertionError("never called")

    checks = (
        (SuffixDecodingProposer, "suffix proposer", drafter._check_suffix),
        (NgramProposer, "free off state", drafter._check_ngram),
    )
    for cls, what, check in checks:
        assert check() is cls  # the pinned vLLM passes
        monkeypatch.setattr(cls, "propose", propose)
        with pytest.raises(drafter.UnsupportedVllmError, match=f"{what}: .*not the signature"):
            check()


def test_install_skips_the_forward_only_at_k0(monkeypatch):
    calls = []

    def stock(self, num_speculative_tokens, target_token_ids=None, common_attn_metadata=None):
        calls.append(num_speculative_tokens)
        return "drafted"

    monkeypatch.setattr(SpecDecodeBaseProposer, "propose", stock)
    drafter.install()
    drafter.install()  # idempotent: one wrapper

    class Metadata:
        def batch_size(self):
            return 3

    proposer = SpecDecodeBaseProposer.__new__(SpecDecodeBaseProposer)
    proposer.device = "cpu"
    empty = SpecDecodeBaseProposer.propose(proposer, 0, common_attn_metadata=Metadata())
    assert tuple(empty.shape) == (3, 0) and calls == []
    assert SpecDecodeBaseProposer.propose(proposer, 2, common_attn_metadata=Metadata()) == "drafted"
    assert calls == [2]
    with pytest.raises(drafter.UnsupportedVllmError, match="without common_attn_metadata"):
        SpecDecodeBaseProposer.propose(proposer, 0)


NGRAM_CHECK = """
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from spectune.engine import drafter
calls = []
def stock(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None):
    calls.append(num_speculative_tokens)
    return [[7] * num_speculative_tokens for _ in sampled_token_ids]
NgramProposer.propose = stock
drafter.install()
assert drafter.install_in_worker()  # both proposers wrapped: what the engine checks at start
proposer = NgramProposer.__new__(NgramProposer)
assert NgramProposer.propose(proposer, 0, [[1], [2], []]) == [[], [], []] and calls == []
assert NgramProposer.propose(proposer, 2, [[1], [2]]) == [[7, 7], [7, 7]] and calls == [2]
print("ok")
"""


def test_install_skips_the_ngram_search_only_at_k0():
    # In a process of its own: the ngram module imports numba, which must not be loaded where
    # vLLM later registers kernels (as this test process does); see drafter.install_in_worker.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NGRAM_CHECK], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_sampling_constraints_over_zero_draft_rows_no_longer_kill_the_worker():
    """vLLM's top-k over an empty draft batch takes max() of nothing; the guard returns the rows unchanged."""
    import torch
    from vllm.v1.sample import rejection_sampler

    from spectune.engine import vllm_fixes

    vllm_fixes.register()
    guarded = rejection_sampler.apply_top_k_top_p
    assert guarded.spectune_fix
    empty, k = torch.empty(0, 32), torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="numel"):
        guarded.stock(empty.clone(), k, None)  # the vLLM bug, still there underneath
    assert guarded(empty, k, None).shape == (0, 32)
    logits = torch.arange(8.0).repeat(2, 1)
    top2 = guarded(logits.clone(), torch.tensor([2, 2], dtype=torch.int32), None)
    assert torch.isfinite(top2).sum(dim=1).tolist() == [2, 2]  # rows still constrained as before
    vllm_fixes.register()
    assert rejection_sampler.apply_top_k_top_p is guarded  # idempotent


def test_step_statistics_fields_are_checked_at_start(monkeypatch):
    from spectune.engine import stats

    stats.check_supported()  # the pinned vLLM has every field step records read
    path = "vllm.v1.spec_decode.metrics.SpecDecodingStats"
    changed = {**stats.FIELDS_READ, path: stats.FIELDS_READ[path] | {"num_drafted"}}
    monkeypatch.setattr(stats, "FIELDS_READ", changed)
    with pytest.raises(drafter.UnsupportedVllmError, match=r"SpecDecodingStats\.num_drafted"):
        stats.check_supported()


def test_every_process_decides_the_vector_isa_alike(monkeypatch):
    """A probe that fails under load in one process must not make it build another's vector code
    without the ISA's flags (engine/vllm_fixes.py): the probe is skipped unless the env var is set."""
    from torch._inductor import config

    from spectune.engine import vllm_fixes

    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    monkeypatch.delenv(vllm_fixes.VEC_ISA_ENV, raising=False)
    vllm_fixes.register()
    assert config.cpp.vec_isa_ok is True
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    monkeypatch.setenv(vllm_fixes.VEC_ISA_ENV, "0")
    vllm_fixes.register()
    assert config.cpp.vec_isa_ok is None  # the operator's choice, which torch read at import
