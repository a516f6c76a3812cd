"""Changing speculation while serving: ``apply`` (scheduler hook, next step)
versus ``rebuild`` (drain, rebuild, resume), under 8 concurrent streams.

Both must fail no request.  The measured times are printed (run with -s) and
quoted in the README.
"""

from __future__ import annotations

import asyncio
import time

import pytest_asyncio

from spectune.engine import RuntimeSettings

from conftest import complete, running_engine, tiny_config

STREAMS = 8


class Load:
    """8 workers issuing back-to-back requests until stopped."""

    def __init__(self, engine) -> None:
        self.engine, self.stop, self.failures = engine, asyncio.Event(), []

    async def worker(self, i: int) -> None:
        k = 0
        while not self.stop.is_set():
            k += 1
            try:
                await complete(self.engine, f"the model draft {i} step {k}", 120, temperature=0.0, ignore_eos=True)
            except Exception as exc:
                self.failures.append(repr(exc))

    async def __aenter__(self):
        self.tasks = [asyncio.create_task(self.worker(i)) for i in range(STREAMS)]
        await asyncio.sleep(1.0)
        return self

    async def __aexit__(self, *exc):
        await asyncio.sleep(1.0)
        self.stop.set()
        await asyncio.gather(*self.tasks)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny):
    async with running_engine(tiny_config(tiny, draft="copy", n=4)) as pair:
        yield pair


async def test_apply_under_load_takes_effect_next_step(engine):
    eng, sink = engine
    async with Load(eng) as load:
        steps_before = len(sink.steps)
        t0 = time.perf_counter()
        await eng.apply(RuntimeSettings(version=1, num_speculative_tokens=1))
        ack = time.perf_counter() - t0
        applied_at = time.time()
        await asyncio.sleep(0.5)
    assert load.failures == []
    records = list(sink.records)
    assert all(r.error is None and r.finish_reason == "length" for r in records)
    # Steps after the ack draft at most 1 token; the first such step comes at once.
    later = [s for s in list(sink.steps)[steps_before:] if s.time > applied_at]
    assert later and all(s.num_speculative_tokens <= 1 for s in later)
    effect = min(s.time for s in later if s.num_speculative_tokens <= 1) - applied_at
    # Requests admitted after the change carry the new N and draft one token a step.
    after = [r for r in records if r.arrival_time > applied_at]
    assert after and all(r.num_speculative_tokens == 1 and r.settings_version == 1 for r in after)
    assert all(r.drafted_per_position[1:] == [0, 0, 0] for r in after)
    print(
        f"\napply: ack {ack * 1000:.1f} ms, first step with new N {effect * 1000:.1f} ms later, "
        f"{len(records)} requests, 0 failed"
    )
    assert ack < 1.0 and effect < 1.0


async def test_switch_off_and_on_per_class(engine):
    eng, sink = engine
    from spectune.engine import ClassSettings

    await eng.apply(
        RuntimeSettings(version=2, num_speculative_tokens=4, classes={"qa": ClassSettings(speculation_enabled=False)})
    )
    _, _, rid = await complete(eng, "short question", 20, temperature=0.0, ignore_eos=True)
    off = next(r for r in sink.records if r.request_id == rid)
    assert not off.speculation_enabled and off.num_draft_tokens == 0 and off.num_speculative_tokens == 0
    _, _, rid = await complete(eng, "short question", 20, temperature=0.0, ignore_eos=True, prompt_class="long")
    on = next(r for r in sink.records if r.request_id == rid)
    assert on.speculation_enabled and on.num_speculative_tokens == 4 and on.drafted_per_position[3] > 0


async def test_rebuild_under_load_fails_nothing(engine, tiny):
    eng, sink = engine
    new_config = tiny_config(tiny, draft="copy", n=4)
    async with Load(eng) as load:
        t0 = time.time()
        paused = await eng.rebuild(new_config, RuntimeSettings(version=3, num_speculative_tokens=2))
    assert load.failures == []
    records = list(sink.records)
    assert all(r.error is None for r in records)
    after = [r for r in records if r.arrival_time > t0 + paused]
    assert after and all(r.num_speculative_tokens == 2 for r in after)
    print(f"\nrebuild: admission paused {paused:.1f} s, 0 failed")
