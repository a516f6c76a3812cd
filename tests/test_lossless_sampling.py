"""Speculative sampling must be lossless: what we ship keeps vLLM's rule.

Accept draft token x with probability min(1, p(x)/q(x)); on rejection sample
from norm(max(0, p - q)).  Three levels:

* the CPU fallback we patch (engine/vllm_fixes.py) really was broken and the
  fix is right;
* vLLM's rejection sampler, fed known p and q, accepts at rate sum min(p, q)
  and emits tokens distributed as p -- while the folk rule "accept when
  p > q" (from the field notes) is measurably biased under the same test;
* the running engine at temperature 1: token distributions with speculation
  equal those without (chi-square homogeneity test).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from conftest import running_engine, tiny_config


@pytest.fixture(scope="module")
def cpu_kernels():
    from vllm.platforms import current_platform

    from spectune.engine import vllm_fixes

    vllm_fixes.register()
    current_platform.register_triton_kernel_overrides()
    return vllm_fixes


def test_stock_expand_kernel_is_broken_and_the_fix_is_right(cpu_kernels):
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor([0.8, 0.5, -1.0])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    expected = torch.tensor([0.8, 0.8, 0.5, 0.5, 0.5, 1.0])
    fixed = expand_batch_to_tokens(temperature, cu, 6, replace_from=-1, replace_to=1)
    assert torch.allclose(fixed, expected)
    stock_out = torch.full((6,), -7.0)
    cpu_kernels.STOCK_EXPAND_KERNEL(stock_out, temperature, cu, -1, 1)
    assert not torch.allclose(stock_out, expected)  # the upstream bug: output untouched


def _metadata(batch: int):
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.ones(batch),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=None,
    )


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return 0.5 * (freq - p.double()).abs().sum().item()


def test_rejection_sampler_follows_the_lossless_rule(cpu_kernels):
    from vllm.v1.sample.rejection_sampler import rejection_sample

    torch.manual_seed(0)
    vocab, batch = 6, 40_000
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q = torch.tensor([0.10, 0.10, 0.30, 0.30, 0.10, 0.10])
    drafts = torch.multinomial(q, batch, replacement=True)
    out = rejection_sample(
        drafts.to(torch.int32).contiguous(),
        [1] * batch,
        1,
        torch.arange(1, batch + 1, dtype=torch.int32),
        q.expand(batch, vocab).contiguous(),
        p.log().expand(batch, vocab).contiguous(),
        torch.zeros(batch, 1, dtype=torch.int32),
        _metadata(batch),
    )
    first = out[:, 0].long()
    accepted = (first == drafts).float().mean().item()
    assert accepted == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.01)
    assert _tv(first, p) < 0.01  # output ~ p, not q

    # The folk rule "accept when p(x) > q(x), else resample from p" is biased:
    naive = torch.where(p[drafts] > q[drafts], drafts, torch.multinomial(p, batch, replacement=True))
    assert _tv(naive, p) > 0.05


PROMPT = "the model draft accept"


async def _sample(config, n: int, tokens: int) -> list[list[int]]:
    async with running_engine(config) as (engine, sink):
        out = await _sample_on(engine, sink, n, tokens)
        drafted = sum(r.num_draft_tokens for r in sink.records)
        accepted = sum(r.num_accepted_tokens for r in sink.records)
        assert drafted and 0.2 < accepted / drafted < 0.95  # genuinely mixed accept/reject
        return out


async def _sample_on(engine, _sink, n: int, tokens: int) -> list[list[int]]:
    """n seeded samples of ``tokens`` tokens each (seed 10000 + i: the same draws on any engine)."""
    from spectune.engine.core import GenerationRequest

    async def one(i: int) -> list[int]:
        ids: list[int] = []
        req = GenerationRequest(
            prompt=PROMPT,
            max_tokens=tokens,
            temperature=1.0,
            seed=10_000 + i,
            ignore_eos=True,
            request_id=f"s-{uuid.uuid4().hex[:8]}",
        )
        async for d in engine.generate(req):
            ids.extend(d.token_ids)
        return ids

    out = []
    for chunk in range(0, n, 64):
        out += await asyncio.gather(*[one(i) for i in range(chunk, min(n, chunk + 64))])
    return out


def _homogeneous(a: list[int], b: list[int]) -> float:
    """Chi-square p-value that two samples share a distribution (rare tokens pooled)."""
    ca, cb = Counter(a), Counter(b)
    common = [t for t, _ in (ca + cb).most_common() if ca[t] + cb[t] >= 10]
    rows = [
        [ca[t] for t in common] + [sum(v for t, v in ca.items() if t not in common)],
        [cb[t] for t in common] + [sum(v for t, v in cb.items() if t not in common)],
    ]
    table = np.array(rows)
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


async def test_engine_sampling_distribution_is_unchanged_by_speculation(tiny, plain_engine):
    n, tokens = 768, 4
    plain = await plain_engine.call(lambda engine, sink: _sample_on(engine, sink, n, tokens))
    spec = await _sample(tiny_config(tiny, draft="noised", n=3), n, tokens)
    for pos in range(1, tokens):  # position 0 comes from prefill, never speculative
        p_value = _homogeneous([s[pos] for s in plain], [s[pos] for s in spec])
        assert p_value > 0.001, f"position {pos}: distributions differ (p={p_value:.2g})"
