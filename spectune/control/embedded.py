"""Policy -> in-process engine: the control loop's last hop.

``EmbeddedControl`` subscribes to the ``PolicyService``: it refuses a document the engine
cannot run without a restart, and a write returns after the engine holds the new settings.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from spectune.engine.schema import RuntimeSettings
from spectune.store.policies import Versioned
from spectune.tuner.policy import Policy, PolicyDocument, runtime_settings

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
            n_max=max(n, cfg.max_speculative_tokens),
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
        """Refuse what this engine cannot do without a restart (the engine's own capacity check)."""
        settings = runtime_settings(doc, self.engine.config.instance_id, self.classes, version=0)
        settings.check_capacity(self.engine.config.max_speculative_tokens)

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
