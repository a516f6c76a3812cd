"""The one place where the pieces meet.

    engine --records--> recorder --> DB            (store)
           --records--> request metrics --> /metrics
    DB <-- retention and latency-histogram jobs (APScheduler)
    DB --> tuner (TunerTask, in the server's loop) --+--> PolicyService --> EmbeddedControl --settings--> engine
                                           API ------+       (a remote engine: PolicyFollower polls the API)

``Stack`` builds them from ``Settings`` and tears them down in order.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from apscheduler.schedulers.background import BackgroundScheduler
from fastapi import FastAPI
from prometheus_client import REGISTRY

from spectune.api.auth import Role, TokenSpec
from spectune.app import create_app, policy_service
from spectune.control import PolicyFollower
from spectune.engine import EngineConfig
from spectune.engine.sinks import JsonlSink, RecordSink
from spectune.settings import Settings
from spectune.store.db import make_engine, upgrade
from spectune.store.histograms import refresh_closed_hours
from spectune.store.instances import fleet, heartbeat
from spectune.store.metrics import FleetCollector, RecorderCollector, RequestMetrics, TunerMetrics
from spectune.store.recorder import Recorder
from spectune.store.retention import expire_prompts, run_retention
from spectune.tuner.diagnosis_job import GIB, DiagnosisRunner
from spectune.tuner.job import Tuner
from spectune.tuner.task import TunerTask

if TYPE_CHECKING:
    from spectune.engine.core import SpecEngine

log = logging.getLogger(__name__)

_METRICS: RequestMetrics | None = None


_TUNER_METRICS: TunerMetrics | None = None


def tuner_metrics() -> TunerMetrics:
    """The process-wide tuner metrics (Prometheus refuses duplicate series names)."""
    global _TUNER_METRICS
    if _TUNER_METRICS is None:
        _TUNER_METRICS = TunerMetrics(REGISTRY)
    return _TUNER_METRICS


def request_metrics() -> RequestMetrics:
    """Process-wide metric families (prometheus_client forbids registering twice)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = RequestMetrics(REGISTRY)
    return _METRICS


@dataclass
class Stack:
    app: FastAPI
    engine: SpecEngine | None
    scheduler: BackgroundScheduler
    collectors: list = field(default_factory=list)

    def close(self) -> None:
        self.scheduler.shutdown(wait=False)
        for collector in self.collectors:
            REGISTRY.unregister(collector)
        # The recorder closes with the engine's sinks (SpecEngine.shutdown).


def api_tokens(settings: Settings) -> dict[str, TokenSpec]:
    """Configured tokens, or one generated operator token kept in a 0600 file."""
    if settings.api_tokens:
        return settings.api_tokens
    path = settings.token_file
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32) + "\n")
    return {"local-operator": TokenSpec(token=path.read_text().strip(), role=Role.OPERATOR)}


def build_stack(settings: Settings, config: EngineConfig | None) -> Stack:
    """Engine (unless ``config`` is None) + recorder + metrics + API + scheduler."""
    upgrade(settings.db)
    db = make_engine(settings.db, pool_pre_ping=True, timeout_s=settings.db_timeout_s)
    maintenance = make_engine(settings.db, pool_pre_ping=True, timeout_s=600)  # retention scans are long
    scheduler = BackgroundScheduler(daemon=True)
    collectors = []
    engine = follower = None
    if config is not None:
        from spectune.engine.core import SpecEngine  # imports vLLM: only where an engine runs

        recorder = Recorder(db, settings.spool_dir, prompt_retention=timedelta(days=settings.prompt_retention_days))
        metrics = request_metrics()
        sinks: list[RecordSink] = [recorder, metrics]
        if settings.records_path is not None:
            sinks.append(JsonlSink(settings.records_path))
        key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
        engine = SpecEngine(config, sinks, openai_api_key=key)
        classes = sorted(config.classifier.classes)
        engine.settings_listeners.append(
            lambda s, cap: metrics.settings_applied(s, sorted(s.classifier.classes) if s.classifier else classes, cap)
        )
        collectors.append(RecorderCollector(lambda: recorder.stats, recorder.spool.pending_bytes))
        REGISTRY.register(collectors[-1])
        if settings.control_plane_url:
            token = settings.control_plane_token.get_secret_value() if settings.control_plane_token else ""
            follower = PolicyFollower(engine, settings.control_plane_url, token)
    scheduler.add_job(
        run_retention,
        "interval",
        seconds=settings.retention_interval_s,
        args=[maintenance, timedelta(days=settings.retention_days), timedelta(days=settings.sums_retention_days)],
        id="retention",
        max_instances=1,
        coalesce=True,
    )
    if engine is not None:
        started_at = datetime.now(UTC)

        def beat() -> None:
            if engine.started:
                cfg = engine.active_config
                name, method = engine.model_name, cfg.method
                heartbeat(db, cfg.instance_id, name, method, engine.capacity, started_at, engine.degraded_reason,
                          engine.settings.version, cfg.draft_model)  # fmt: skip

        scheduler.add_job(beat, "interval", seconds=15, id="heartbeat", max_instances=1, coalesce=True)
        # Also at start and on every change, in the scheduler's threads: a listener runs in the event
        # loop, and a database write there would stall /v1 for as long as the database takes.
        engine.settings_listeners.append(
            lambda s, cap: scheduler.add_job(beat, id="heartbeat-now", replace_existing=True)
        )
    scheduler.add_job(
        lambda: refresh_closed_hours(maintenance, timedelta(days=settings.retention_days), datetime.now(UTC)),
        "interval",
        seconds=settings.retention_interval_s,
        id="latency-histograms",
        max_instances=1,
        coalesce=True,
    )
    scheduler.add_job(
        expire_prompts,
        "interval",
        seconds=settings.retention_interval_s,
        args=[maintenance],
        id="prompt-expiry",
        max_instances=1,
        coalesce=True,
    )
    scheduler.start()
    models = None  # the (target, draft) pair to diagnose, read at each submission
    if engine is not None and config.method == "draft_model" and config.draft_model:
        models = lambda: (engine.config.model, engine.config.draft_model or "")  # noqa: E731
    elif engine is None and settings.model and settings.draft_model:  # a control plane with the pair at hand
        models = lambda: (settings.model, settings.draft_model)  # noqa: E731
    diagnosis = (
        DiagnosisRunner(db, models, settings.diagnosis_cpu_share, settings.diagnosis_memory_headroom_gib * GIB)
        if models
        else None
    )
    policies = policy_service(db, engine, follower, settings.classifier)
    tuner = None
    if follower is None:  # a follower's policy belongs to its control plane's tuner

        def instances() -> list[dict]:
            current = policies.repository.current()
            return fleet(db, current.version if current else None, current.at if current else None)

        collectors.append(FleetCollector(instances))
        REGISTRY.register(collectors[-1])
        tuner = TunerTask(
            Tuner(
                policies,
                request_diagnosis=(lambda cls: diagnosis.submit("tuner", cls)) if diagnosis else None,
                window=timedelta(seconds=settings.tuner_window_s),
                interval=timedelta(seconds=settings.tuner_interval_s),
                cost_window=timedelta(seconds=settings.tuner_cost_window_s),
                on_decisions=tuner_metrics().observe,
            ),
            settings.tuner_interval_s,
        )
    app = create_app(
        engine, db, api_tokens(settings), follower, diagnosis, settings.max_body_bytes, settings.classifier,
        policies=policies, tuner=tuner,
    )  # fmt: skip
    return Stack(app=app, engine=engine, scheduler=scheduler, collectors=collectors)
