"""Policy -> remote engine: ``PolicyFollower`` polls the control plane's
``/api/v1/engines/{instance}/settings`` with ``If-None-Match`` and applies what changed
(a method or drafter change as a rolling rebuild, one engine of the fleet at a time).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from spectune.engine.schema import RuntimeSettings

from .embedded import rebuilt_config

if TYPE_CHECKING:
    from spectune.engine.config import EngineConfig
    from spectune.engine.core import SpecEngine

log = logging.getLogger(__name__)


class PolicyFollower:
    """Keeps a remote engine on the control plane's policy (poll with ETag)."""

    def __init__(self, engine: SpecEngine, base_url: str, token: str, interval: float = 2.0) -> None:
        self.engine, self.interval = engine, interval
        self.client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        self.etag: str | None = None
        self._task: asyncio.Task | None = None

    async def poll_once(self) -> bool:
        headers = {"If-None-Match": self.etag} if self.etag else {}
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(3),
            wait=wait_exponential(0.2, max=2),
            retry=retry_if_exception_type(httpx.TransportError),
            reraise=True,
        ):
            with attempt:
                response = await self.client.get(
                    f"/api/v1/engines/{self.engine.config.instance_id}/settings", headers=headers
                )
        if response.status_code == 304:
            return False
        response.raise_for_status()
        settings = RuntimeSettings.model_validate(response.json())
        new = rebuilt_config(self.engine.config, settings)
        if new is not None and not await self._rebuild(new, settings):
            return False  # another instance is rebuilding: ask again next poll (no ETag kept)
        if new is None:
            await self.engine.apply(settings)
        self.etag = response.headers.get("ETag")
        return True

    async def _rebuild(self, new: EngineConfig, settings: RuntimeSettings) -> bool:
        """A rolling rebuild: take the fleet's slot, rebuild (requests wait, none fail), give it back."""
        slot = f"/api/v1/engines/{self.engine.config.instance_id}/rebuild-slot"
        taken = await self.client.post(slot)
        if taken.status_code == 409:
            log.info("method/drafter change waits: %s", taken.json().get("detail"))
            return False
        taken.raise_for_status()
        try:
            paused = await self.engine.rebuild(new, settings)
            log.info("rebuilt for %s (%s) in %.1f s", new.method, new.draft_model, paused)
        finally:
            await self.client.delete(slot)
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as exc:
                log.warning("policy poll failed, keeping settings v%s: %s", self.engine.settings.version, exc)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self.client.aclose()
