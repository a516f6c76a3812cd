"""The real engine on tiny fp32 models: speculation is lossless and its
per-request telemetry is complete and consistent.

One engine per configuration (start-up ~15-30 s), all prompts through each; the
reference is the session's plain engine (conftest.PlainEngine).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest_asyncio

from conftest import PROMPTS, complete, running_engine, tiny_config

MAX_TOKENS = 24
N = 4


async def _greedy(engine, sink) -> tuple[dict[str, list[int]], list]:
    runs = [complete(engine, p, MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    results = await asyncio.gather(*runs)
    await asyncio.sleep(0)
    request_ids = {rid for _, _, rid in results}
    outputs = {p: ids for p, (_, ids, _) in zip(PROMPTS, results, strict=True)}
    return outputs, [r for r in sink.records if r.request_id in request_ids]


async def _greedy_run(config) -> tuple[dict[str, list[int]], list]:
    async with running_engine(config) as (engine, sink):
        return await _greedy(engine, sink)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(plain_engine):
    outputs, records = await plain_engine.call(_greedy)
    assert len(records) == len(PROMPTS)
    assert all(r.num_draft_tokens == 0 and not r.speculation_enabled for r in records)
    return outputs


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["copy", "indep", "ngram"])
async def speculative(request, tiny):
    if request.param == "ngram":
        config = tiny_config(tiny, method="ngram", n=N)
    else:
        config = tiny_config(tiny, draft=request.param, n=N)
    outputs, records = await _greedy_run(config)
    return request.param, outputs, records


async def test_greedy_output_equals_plain_decoding(reference, speculative):
    name, outputs, records = speculative
    assert len(outputs) >= 20
    mismatched = [p for p in PROMPTS if outputs[p] != reference[p]]
    assert not mismatched, f"{name}: speculation changed greedy output for {mismatched[:3]}"
    assert sum(r.num_draft_tokens for r in records) > 0, f"{name}: nothing was drafted"


async def test_acceptance_matches_the_draft(speculative):
    name, _, records = speculative
    drafted = sum(r.num_draft_tokens for r in records)
    accepted = sum(r.num_accepted_tokens for r in records)
    rate = accepted / drafted
    if name == "copy":
        assert rate == 1.0
    elif name == "indep":
        assert rate < 0.10


async def test_per_request_metrics_are_consistent(speculative):
    name, _, records = speculative
    assert len(records) == len(PROMPTS)
    for r in records:
        assert r.finish_reason == "length" and r.error is None
        assert r.prompt_text is None  # prompt sampling is off by default
        assert r.output_tokens == MAX_TOKENS and r.prompt_tokens > 0
        assert r.prompt_class == "qa" and r.speculation_enabled and r.num_speculative_tokens == N
        assert 0 <= r.num_accepted_tokens <= r.num_draft_tokens
        assert sum(r.drafted_per_position) == r.num_draft_tokens
        assert sum(r.accepted_per_position) == r.num_accepted_tokens
        for counts in (r.drafted_per_position, r.accepted_per_position):
            assert len(counts) == N
            assert all(a >= b for a, b in itertools.pairwise(counts)), counts
        assert all(a <= d for a, d in zip(r.accepted_per_position, r.drafted_per_position))
        # Token accounting (documented in README): the prefill step yields 1
        # token, a verify step accepted + 1, a decode step without drafts 1;
        # the last step may overshoot max_tokens by at most N tokens, which
        # are cut.  So tokens >= 1 + accepted + verify steps - N.
        assert r.output_tokens >= 1 + r.num_accepted_tokens + r.num_spec_steps - N
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert r.tpot_s is not None and r.tpot_s > 0
        assert r.batch_size_max is not None and 1 <= r.batch_size_mean <= r.batch_size_max <= 16
    if name == "copy":
        # every verify step accepts all N drafts: 1 + steps*(N+1) >= tokens
        for r in records:
            assert r.num_accepted_tokens == r.num_draft_tokens == N * r.num_spec_steps
            assert r.output_tokens <= 1 + r.num_spec_steps * (N + 1) < r.output_tokens + N + 1
