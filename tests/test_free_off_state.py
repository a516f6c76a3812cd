"""Speculation off costs nothing: no draft-model forward in a step where no request
speculates, and no draft ever proposed from a draft KV cache that missed positions.

Tiny fp32 models (exact equality holds in fp32), a copy draft (any stale draft KV
shows up as rejected drafts), and a plain engine as the reference.  The draft
model's forward passes are counted by a hook inside vLLM's worker
(``SpecEngine.count_draft_forwards``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from spectune.engine import ClassSettings, RuntimeSettings

from conftest import complete, running_engine, tiny_config

CAPACITY = 4


def settings(version: int, n: int, **kw) -> RuntimeSettings:
    return RuntimeSettings(version=version, num_speculative_tokens=n, speculation_enabled=n > 0, **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny):
    async with running_engine(tiny_config(tiny, draft="copy", n=CAPACITY)) as pair:
        yield pair


async def until(condition, timeout: float = 60.0) -> None:
    """Wait until ``condition()`` holds (engine steps arrive through the stat logger)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


async def test_no_draft_forward_when_no_request_speculates(engine):
    eng, sink = engine
    await eng.apply(settings(10, 0))
    before = await eng.count_draft_forwards()
    prompts = [f"switched off request {i}" for i in range(8)]
    await asyncio.gather(*[complete(eng, p, 32, temperature=0.0, ignore_eos=True) for p in prompts])
    assert await eng.count_draft_forwards() == before, "the draft model ran while speculation was off"
    off_records = list(sink.records)[-8:]
    assert all(r.num_draft_tokens == 0 and r.output_tokens == 32 for r in off_records)

    # One class off, another on: a request of the off class alone runs no draft forward.
    await eng.apply(settings(11, CAPACITY, classes={"qa": ClassSettings(speculation_enabled=False)}))
    before = await eng.count_draft_forwards()
    await complete(eng, "off class alone", 24, temperature=0.0, ignore_eos=True, prompt_class="qa")
    assert await eng.count_draft_forwards() == before
    await complete(eng, "on class alone", 24, temperature=0.0, ignore_eos=True, prompt_class="long")
    speculating = await eng.count_draft_forwards() - before
    # The counter sees real drafting: prefill + N forwards per verify step.
    record = sink.records[-1]
    assert record.num_draft_tokens > 0 and speculating >= record.num_draft_tokens


async def test_off_on_off_while_requests_run(engine, plain_engine):
    eng, sink = engine
    wave_a = [f"first wave request {i} runs across off and on" for i in range(6)]
    wave_b = [f"second wave {i} admitted after resuming" for i in range(6)]
    reference = {
        p: ids
        for p, (_, ids, _) in zip(
            wave_a + wave_b,
            await asyncio.gather(
                *[
                    plain_engine.complete(p, 160 if p in wave_a else 64, temperature=0.0, ignore_eos=True)
                    for p in wave_a + wave_b
                ]
            ),
        )
    }

    def steps_after(t: float, drafted: bool) -> int:
        return sum(1 for s in list(sink.steps) if s.time > t and (s.num_draft_tokens > 0) == drafted)

    await eng.apply(settings(20, CAPACITY))
    t_on = time.time()
    tasks_a = [asyncio.create_task(complete(eng, p, 160, temperature=0.0, ignore_eos=True)) for p in wave_a]
    await until(lambda: steps_after(t_on, drafted=True) >= 3)
    await eng.apply(settings(21, 0))
    t_off = time.time()
    forwards_off = await eng.count_draft_forwards()
    await until(lambda: steps_after(t_off, drafted=False) >= 5)
    assert await eng.count_draft_forwards() == forwards_off
    await eng.apply(settings(22, CAPACITY))
    t_resume = time.time()
    tasks_b = [asyncio.create_task(complete(eng, p, 64, temperature=0.0, ignore_eos=True)) for p in wave_b]
    await until(lambda: steps_after(t_resume, drafted=True) >= 3)
    await eng.apply(settings(23, 0))
    results = await asyncio.gather(*tasks_a, *tasks_b)
    assert all(not t.done() or t.exception() is None for t in tasks_a + tasks_b)

    outputs = {p: ids for p, (_, ids, _) in zip(wave_a + wave_b, results)}
    assert outputs == reference, "greedy output differs from the plain engine's"
    by_id = {r.request_id: r for r in sink.records}
    records_a = [by_id[rid] for _, _, rid in results[: len(wave_a)]]
    records_b = [by_id[rid] for _, _, rid in results[len(wave_a) :]]
    # Every draft proposed, before the pause and after resuming, was accepted: a copy
    # draft rejects tokens as soon as it drafts from a cache with missing positions.
    for r in records_a + records_b:
        assert r.num_accepted_tokens == r.num_draft_tokens, (r.request_id, r.accepted_per_position)
    assert all(r.num_draft_tokens > 0 for r in records_a), "wave A speculated before the pause"
    assert all(r.num_draft_tokens > 0 for r in records_b), "requests admitted after resuming speculate"
    # Wave A was demoted at the pause (its draft KV missed positions) and stayed plain.
    assert all(r.num_spec_steps < 20 for r in records_a), [r.num_spec_steps for r in records_a]


@pytest.mark.parametrize("n", [0, 2])
async def test_step_k_follows_the_scheduled_requests(engine, n):
    """A step's K is the largest N among the requests it schedules (not those waiting)."""
    eng, sink = engine
    await eng.apply(settings(30 + n, CAPACITY, classes={"qa": ClassSettings(num_speculative_tokens=n)}))
    _, _, rid = await complete(eng, "class qa alone", 24, temperature=0.0, ignore_eos=True, prompt_class="qa")
    record = next(r for r in sink.records if r.request_id == rid)
    assert record.num_speculative_tokens == n
    assert len([c for c in record.drafted_per_position if c > 0]) == n
