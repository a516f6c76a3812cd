"""A remote engine follows a control plane's policy (`--control-plane`):
it polls with If-None-Match and applies changes within its poll interval."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest_asyncio
import uvicorn

from spectune.api.auth import Role, TokenSpec
from spectune.app import create_app
from spectune.control import PolicyFollower
from spectune.store.db import make_engine, upgrade

from conftest import free_port, running_engine, tiny_config

OPERATOR = {"Authorization": "Bearer op"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def control_plane(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('cp')}/cp.db"
    upgrade(url)
    app = create_app(None, make_engine(url), {"op": TokenSpec(token="op", role=Role.OPERATOR)})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


async def test_remote_engine_follows_policy(control_plane, tiny):
    async with running_engine(tiny_config(tiny, draft="copy", n=4)) as (engine, _):
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
