"""A remote engine follows a control plane's policy (`--control-plane`):
it polls with If-None-Match and applies changes within its poll interval."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest_asyncio

from spectune.control import PolicyFollower

from conftest import control_plane_on_loopback, running_engine, tiny_config

OPERATOR = {"Authorization": "Bearer op"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def control_plane(tmp_path_factory):
    async with control_plane_on_loopback(f"sqlite:///{tmp_path_factory.mktemp('cp')}/cp.db") as base:
        yield base


async def test_remote_engine_follows_policy(control_plane, tiny):
    async with running_engine(tiny_config(tiny, draft="copy", n=4)) as (engine, _):
        heard = []  # what a listener (the heartbeat) reads from the engine when told of a change
        engine.settings_listeners.append(lambda settings, _: heard.append((settings.version, engine.settings.version)))
        follower = PolicyFollower(engine, control_plane, "op", interval=0.2)
        assert await follower.poll_once() is True  # first poll applies version 1
        assert await follower.poll_once() is False  # 304: nothing changed
        follower.start()
        async with httpx.AsyncClient(base_url=control_plane, headers=OPERATOR) as client:
            etag = (await client.get("/api/v1/policy")).headers["ETag"]
            t0 = time.perf_counter()
            r = await client.patch(
                "/api/v1/policy", json={"classes": {"qa": {"num_speculative_tokens": 1}}}, headers={"If-Match": etag}
            )
            assert r.status_code == 200
            while engine.settings.version != 2:
                assert time.perf_counter() - t0 < 5, "change did not arrive within 5 s"
                await asyncio.sleep(0.05)
        print(f"\nremote engine applied the change {(time.perf_counter() - t0) * 1000:.0f} ms after the PATCH")
        assert engine.settings.n_for("qa", 1, engine.capacity) == 1
        await follower.stop()
    assert heard == [(1, 1), (2, 2)]  # the engine already holds what listeners are told of
