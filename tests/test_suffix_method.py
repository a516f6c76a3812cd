"""Suffix decoding (``--method suffix``, vLLM's proposer over arctic-inference's suffix trees) served
and steered like the other methods: greedy output equals a plain engine's while the policy moves N
(and off) mid-flight, the N in force caps every draft, acceptance is recorded per position, and the
trees learn from earlier responses (what prompt lookup cannot).  Tiny fp32 models."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from spectune.engine import RuntimeSettings
from spectune.engine import drafter as drafter_module
from spectune.engine.drafter import UnsupportedVllmError
from spectune.tuner.token_replay import SuffixSettings, replay_suffix

from conftest import complete, running_engine, tiny_config

CAPACITY = 4  # scripts/bootstrap builds arctic-inference: no skip when it is missing

REPEATING = [
    "alpha beta gamma delta alpha beta gamma delta alpha beta",
    "def add ( a , b ) : return a + b def add ( a , b ) :",
    "red green blue red green blue red green blue red green",
    "one two three four one two three four one two",
]


def settings(version: int, n: int) -> RuntimeSettings:
    return RuntimeSettings(version=version, num_speculative_tokens=n, speculation_enabled=n > 0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suffix(tiny):
    async with running_engine(tiny_config(tiny, method="suffix", n=CAPACITY)) as pair:
        yield pair


async def test_replay_equals_what_the_suffix_engine_reports(suffix, plain_engine):
    """Runs first in this module: the engine's trees are still empty, as the replay's are.  A repeat
    of an earlier prompt checks that the global tree (earlier responses) is replayed too."""
    eng, sink = suffix
    n, max_tokens = 3, 32
    await eng.apply(settings(1, n))
    prompts = [*REPEATING, "tokens seen once: quartz maple ember lantern", REPEATING[1]]
    served = []
    for prompt in prompts:  # one after another: batch 1, as the replay assumes
        _, reference, _ = await plain_engine.complete(prompt, max_tokens + CAPACITY, temperature=0.0, ignore_eos=True)
        _, ids, rid = await complete(eng, prompt, max_tokens, temperature=0.0, ignore_eos=True)
        assert ids == reference[:max_tokens]
        served.append((eng.tokenize(prompt), reference, sink.by_id(rid)))
    replayed = replay_suffix(
        [(prompt, reference, max_tokens, False) for prompt, reference, _ in served],
        n,
        SuffixSettings(capacity=CAPACITY, max_model_len=eng.active_config.max_model_len),
    )
    for prompt, (_, _, record), replay in zip(prompts, served, replayed, strict=True):
        assert replay.drafted_per_position == record.drafted_per_position[:n], prompt
        assert replay.accepted_per_position == record.accepted_per_position[:n], prompt
        assert replay.verify_steps == record.num_spec_steps, prompt
    assert sum(sum(r.accepted_per_position) for r in replayed) >= 10  # the prompts made suffix draft (24 here)
    assert replayed[-1].acceptance >= replayed[1].acceptance  # the repeat also drafts from the first response


async def test_greedy_output_equals_plain_while_n_moves(suffix, plain_engine):
    eng, sink = suffix
    prompts = [f"{p} {i}" for i in range(3) for p in REPEATING]
    runs = await asyncio.gather(*[plain_engine.complete(p, 48, temperature=0.0, ignore_eos=True) for p in prompts])
    reference = [ids for _, ids, _ in runs]
    tasks = [asyncio.create_task(complete(eng, p, 48, temperature=0.0, ignore_eos=True)) for p in prompts]
    for version, n in enumerate([CAPACITY, 0, 2, CAPACITY, 1], start=1):
        await eng.apply(settings(version, n))
        await asyncio.sleep(0)  # let the engine step under each setting before the next
        done = sum(t.done() for t in tasks)
        while sum(t.done() for t in tasks) == done and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)  # one request finishes under each N
    results = await asyncio.gather(*tasks)
    assert [ids for _, ids, _ in results] == reference, "greedy output differs from the plain engine's"
    records = [sink.by_id(rid) for _, _, rid in results]
    assert all(r.speculation_method == "suffix" for r in records)
    assert sum(r.num_draft_tokens for r in records) > 100  # repetitive prompts: suffix drafts
    for r in records:
        assert len(r.drafted_per_position) <= CAPACITY
        assert all(a <= d for a, d in zip(r.accepted_per_position, r.drafted_per_position, strict=True))
        # a draft is a prefix: position j+1 is drafted only where j was
        drafted = r.drafted_per_position
        assert all(drafted[j] >= drafted[j + 1] for j in range(len(drafted) - 1))


@pytest.mark.parametrize("n", [0, 2])
async def test_the_n_in_force_caps_every_draft(suffix, n):
    eng, sink = suffix
    await eng.apply(settings(100 + n, n))
    runs = [complete(eng, f"{p} capped {n}", 32, temperature=0.0, ignore_eos=True) for p in REPEATING]
    results = await asyncio.gather(*runs)
    records = [sink.by_id(rid) for _, _, rid in results]
    if n == 0:
        assert all(r.num_draft_tokens == 0 for r in records)
    else:
        assert sum(r.num_draft_tokens for r in records) > 0
        assert all(sum(r.drafted_per_position[n:]) == 0 for r in records), [r.drafted_per_position for r in records]


async def test_a_response_served_before_is_drafted_from_the_tree(suffix):
    """The global tree holds earlier responses: the same request again is drafted from it."""
    eng, sink = suffix
    await eng.apply(settings(200, CAPACITY))
    prompt = "tokens seen once: quartz maple ember lantern"
    _, first_ids, first = await complete(eng, prompt, 48, temperature=0.0, ignore_eos=True)
    _, second_ids, second = await complete(eng, prompt, 48, temperature=0.0, ignore_eos=True)
    assert second_ids == first_ids
    a, b = sink.by_id(first), sink.by_id(second)
    assert b.num_accepted_tokens > a.num_accepted_tokens
    assert b.num_accepted_tokens / max(1, b.num_draft_tokens) >= 0.9, b.accepted_per_position


def test_a_missing_arctic_inference_fails_at_start(monkeypatch):
    monkeypatch.setattr(drafter_module, "SUFFIX_PACKAGE", "arctic_inference_not_installed")
    with pytest.raises(UnsupportedVllmError, match="arctic-inference"):
        drafter_module.check_method("suffix")
    drafter_module.check_method("ngram")  # other methods need nothing more
