"""Policy -> engine: the control loop's last hop.

``EmbeddedControl`` applies the current policy to the in-process engine
(in-process notification: a write returns after the engine holds the new
settings).  ``PolicyFollower`` is the same for a remote engine: it polls
the control plane's ``/api/v1/engines/{instance}/settings`` with
``If-None-Match`` and applies what changed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from spectune.engine.schema import RuntimeSettings
from spectune.store.policies import Versioned
from spectune.tuner.policy import Policy, PolicyDocument, effective_policy, runtime_settings

if TYPE_CHECKING:
    from spectune.engine.config import EngineConfig
    from spectune.engine.core import SpecEngine

log = logging.getLogger(__name__)


def initial_policy(engine: SpecEngine) -> PolicyDocument:
    """Version 1 when the store has no policy: what the engine was started with."""
    cfg = engine.config
    n = cfg.initial.num_speculative_tokens
    return PolicyDocument(
        global_=Policy(
            speculation_enabled=cfg.initial.speculation_enabled,
            num_speculative_tokens=n,
            n_min=0,
            n_max=max(n, cfg.num_speculative_tokens),
        )
    )


class EmbeddedControl:
    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine

    @property
    def classes(self) -> set[str]:
        """The engine's start-up classes (a policy's classifier replaces them while it is in force)."""
        return set(self.engine.config.classifier.classes)

    def check(self, doc: PolicyDocument) -> None:
        """Refuse what this engine cannot do without a restart."""
        capacity = self.engine.config.num_speculative_tokens
        for prompt_class in [None, *sorted(doc.known_classes(self.classes))]:
            p = effective_policy(doc, self.engine.config.instance_id, prompt_class)
            largest = max([p.num_speculative_tokens] + [r.num_speculative_tokens for r in p.batch_table])
            if largest > capacity:
                raise ValueError(
                    f"num_speculative_tokens {largest} exceeds this engine's capacity {capacity} "
                    f"(restart with --max-speculative-tokens {largest})"
                )

    async def apply(self, current: Versioned) -> RuntimeSettings:
        doc = PolicyDocument.model_validate(current.body)
        settings = runtime_settings(doc, self.engine.config.instance_id, self.classes, current.version)
        new = rebuilt_config(self.engine.config, settings)
        if new is not None:
            # vLLM fixes the drafter at start-up: a method/drafter change is a managed rebuild.
            self.engine.spawn(self.engine.rebuild(new, settings))
            return settings
        await self.engine.apply(settings)
        return settings


def rebuilt_config(cfg: EngineConfig, settings: RuntimeSettings) -> EngineConfig | None:
    """The engine config that ``settings`` asks for when its method or drafter differ, else None."""
    method = settings.method or cfg.method
    draft = (settings.draft_model or cfg.draft_model) if method == "draft_model" else None
    if (method, draft) == (cfg.method, cfg.draft_model if cfg.method == "draft_model" else None):
        return None
    return cfg.model_copy(update={"method": method, "draft_model": draft})


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
