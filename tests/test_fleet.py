"""A fleet on loopback: one control plane on PostgreSQL, three engines on the tiny models, following its policy.

Slow tier (three engines start and each rebuilds once).  Shown: one policy PATCH reaches all
three within two poll intervals; a drafter change rolls through them one at a time (the rebuild
slot) with every request answered and never more than one engine paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
import pytest_asyncio

from spectune.control import PolicyFollower

from conftest import PROMPTS, complete, control_plane_on_loopback, running_engine, tiny_config

pytestmark = pytest.mark.slow
OPERATOR = {"Authorization": "Bearer op"}
POLL_S = 0.5
ENGINES = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def control_plane(pg_server):
    pg_server.reset()
    async with control_plane_on_loopback(pg_server.url) as base:  # the fleet's store: PostgreSQL
        yield base


async def _patch(base: str, body: dict) -> int:
    async with httpx.AsyncClient(base_url=base, headers=OPERATOR, timeout=30) as client:
        etag = (await client.get("/api/v1/policy")).headers["ETag"]
        r = await client.patch("/api/v1/policy", json=body, headers={"If-Match": etag})
        assert r.status_code == 200, r.text
        return r.json()["version"]


@pytest.mark.timeout(1500)  # above the deadlines inside (a roll of three rebuilds took 386 s of the default 600)
async def test_changes_reach_the_fleet_and_a_drafter_change_rolls_one_engine_at_a_time(control_plane, tiny):
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for i in range(ENGINES):
            config = tiny_config(tiny, draft="copy", n=3).model_copy(update={"instance_id": f"engine-{i}"})
            engine, _ = await stack.enter_async_context(running_engine(config))
            follower = PolicyFollower(engine, control_plane, "op", interval=POLL_S)
            await follower.poll_once()
            follower.start()
            stack.push_async_callback(follower.stop)
            engines.append(engine)

        # 1. Runtime settings: one PATCH, every engine holds it (how fast is printed: two polls by design;
        # the deadline only stops a hang -- three engines on 2 shared cores stretch any window).
        t0 = time.perf_counter()
        version = await _patch(control_plane, {"classes": {"qa": {"num_speculative_tokens": 1}}})
        while any(e.settings.version != version for e in engines):
            if time.perf_counter() - t0 > 120:
                pytest.fail(f"not every engine reached v{version} within 120 s")
            await asyncio.sleep(0.01)
        reached = time.perf_counter() - t0
        print(f"\nPATCH -> all {ENGINES} engines hold v{version} in {reached * 1000:.0f} ms (poll {POLL_S} s)")

        # 2. A drafter change under load: a rolling rebuild.
        failures: list[BaseException] = []
        answered = [0]
        paused_max = [0]
        order: list[str] = []
        stop = asyncio.Event()

        async def load(engine, k: int) -> None:
            while not stop.is_set():
                try:
                    await complete(engine, PROMPTS[k % len(PROMPTS)], max_tokens=8)
                    answered[0] += 1
                except Exception as exc:  # every client-visible failure counts
                    failures.append(exc)
                k += 1

        async def watch() -> None:
            while not stop.is_set():
                paused = [e.config.instance_id for e in engines if not e.running]
                paused_max[0] = max(paused_max[0], len(paused))
                for name in paused:
                    if name not in order:
                        order.append(name)
                await asyncio.sleep(0.005)

        # One client per engine: on 2 cores more load mostly stretches each rebuild, not what is shown.
        tasks = [asyncio.create_task(load(e, 7 * i)) for i, e in enumerate(engines)]
        tasks.append(asyncio.create_task(watch()))

        async def until(condition, what: str) -> None:  # the deadline only stops a hang
            deadline = time.perf_counter() + 300
            while not condition():
                assert time.perf_counter() < deadline and not failures, (what, failures[:3])
                await asyncio.sleep(0.05)

        await until(lambda: answered[0] >= ENGINES, "the load never got going")  # load running before the change
        new_draft = str(tiny["noised"])
        t0 = time.perf_counter()
        await _patch(control_plane, {"global": {"draft_model": new_draft}})
        deadline = time.perf_counter() + 600
        while any(e.config.draft_model != new_draft or not e.running for e in engines):
            assert time.perf_counter() < deadline, "the rolling change did not finish in 10 min"
            await asyncio.sleep(0.1)
        rolled = time.perf_counter() - t0
        served_before = answered[0]
        await until(lambda: answered[0] >= served_before + ENGINES, "nothing served after the roll")  # and after it
        stop.set()
        await asyncio.gather(*tasks)
        print(f"drafter change rolled through {ENGINES} engines in {rolled:.1f} s, order {order}; "
              f"{answered[0]} requests answered, {len(failures)} failed, at most {paused_max[0]} paused")  # fmt: skip
        assert failures == [] and answered[0] > 0
        assert paused_max[0] == 1 and sorted(order) == [f"engine-{i}" for i in range(ENGINES)]
        assert all(e.config.draft_model == new_draft for e in engines)
