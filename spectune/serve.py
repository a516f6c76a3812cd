"""The one place where the pieces meet.

    engine --records--> recorder --> DB            (store)
           --records--> request metrics --> /metrics
    DB <-- retention job (APScheduler)

``Stack`` builds them from ``Settings`` and tears them down in order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import REGISTRY

from spectune.engine import EngineConfig
from spectune.engine.core import SpecEngine
from spectune.engine.sinks import JsonlSink, RecordSink
from spectune.settings import Settings
from spectune.store.db import make_engine, upgrade
from spectune.store.metrics import RecorderCollector, RequestMetrics
from spectune.store.recorder import Recorder
from spectune.store.retention import roll_up

log = logging.getLogger(__name__)

_METRICS: RequestMetrics | None = None


def request_metrics() -> RequestMetrics:
    """Process-wide metric families (prometheus_client forbids registering twice)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = RequestMetrics(REGISTRY)
    return _METRICS


@dataclass
class Stack:
    engine: SpecEngine
    recorder: Recorder | None
    scheduler: BackgroundScheduler
    collectors: list = field(default_factory=list)

    def close(self) -> None:
        self.scheduler.shutdown(wait=False)
        for collector in self.collectors:
            REGISTRY.unregister(collector)
        # The recorder closes with the engine's sinks (SpecEngine.shutdown).


def build_stack(settings: Settings, config: EngineConfig) -> Stack:
    upgrade(settings.db)
    db = make_engine(settings.db, pool_pre_ping=True)
    recorder = Recorder(db, settings.spool_dir)
    metrics = request_metrics()
    sinks: list[RecordSink] = [recorder, metrics]
    if settings.records_path is not None:
        sinks.append(JsonlSink(settings.records_path))
    engine = SpecEngine(config, sinks)
    classes = sorted(config.classifier.classes)
    engine.settings_listeners.append(lambda s, cap: metrics.settings_applied(s, classes, cap))
    collector = RecorderCollector(lambda: recorder.stats, recorder.spool.pending_bytes)
    REGISTRY.register(collector)
    scheduler = BackgroundScheduler(daemon=True)
    scheduler.add_job(
        roll_up, "interval", seconds=settings.retention_interval_s, args=[db, timedelta(days=settings.retention_days)],
        id="retention", max_instances=1, coalesce=True,
    )
    scheduler.start()
    return Stack(engine=engine, recorder=recorder, scheduler=scheduler, collectors=[collector])
