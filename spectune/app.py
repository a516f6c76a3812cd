"""The HTTP application: the control-plane API (/api/v1), health, metrics,
and vLLM's OpenAI server (/v1 and the rest of ``vllm serve``'s routes).  With ``engine=None`` it is the control plane
alone, for a fleet of remote engines that follow it."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from spectune.api import alerts, fidelity, fleet, overview, records
from spectune.api import policies as policy_routes
from spectune.api.auth import TokenSpec
from spectune.api.deps import Services
from spectune.control import EmbeddedControl, PolicyFollower, PolicyService, initial_policy
from spectune.engine.classifier import PromptClassifier
from spectune.guard import RequestGuard
from spectune.tuner.diagnosis_job import DiagnosisRunner
from spectune.tuner.policy import PolicyDocument
from spectune.tuner.task import TunerTask

if TYPE_CHECKING:  # the engine's modules import vLLM: a control plane alone (--no-engine) runs without it
    from spectune.engine.core import SpecEngine
    from spectune.engine.openai_server import OpenAIServer

log = logging.getLogger(__name__)


def policy_service(
    db: Engine, engine: SpecEngine | None, follower: PolicyFollower | None, classifier: PromptClassifier | None
) -> PolicyService:
    """The control path: the in-process engine subscribes unless it follows a remote control plane."""
    startup = (engine.config.classifier if engine else classifier or PromptClassifier()).classes
    service = PolicyService(db, set(startup))
    if engine is not None and follower is None:
        service.subscribe(EmbeddedControl(engine))
    return service


def create_app(
    engine: SpecEngine | None,
    db: Engine,
    api_tokens: dict[str, TokenSpec],
    follower: PolicyFollower | None = None,
    diagnosis: DiagnosisRunner | None = None,
    max_body_bytes: int = 4 << 20,
    classifier: PromptClassifier | None = None,
    policies: PolicyService | None = None,
    tuner: TunerTask | None = None,
) -> FastAPI:
    """``follower``: this engine obeys a remote control plane instead of its own store.
    ``classifier``: a control plane's start-up classes (an engine has its own).
    ``policies``: the control path (``policy_service``, built here when not given).
    ``tuner``: runs in the server's event loop from start to shutdown."""
    openai = None
    if engine is not None:
        from spectune.engine.openai_server import OpenAIServer

        openai = OpenAIServer(engine)
    policies = policies or policy_service(db, engine, follower, classifier)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if engine is not None and not engine.started:  # tests may hand in a started engine
            await engine.start()
        elif engine is not None:
            await openai.rebind()
        await policies.resume(initial_policy(engine) if engine else PolicyDocument(), "spectune")
        if follower is not None:
            follower.start()
        if tuner is not None:
            tuner.start()
        try:
            yield
        finally:
            if tuner is not None:
                await tuner.stop()
            if follower is not None:
                await follower.stop()
            if diagnosis is not None:
                diagnosis.shutdown()  # queued diagnoses are dropped; the worker exits with this process
            if engine is not None:
                await engine.shutdown()

    app = FastAPI(
        title="spectune",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible serving with speculative decoding, and its control plane.",
    )
    app.state.services = Services(db=db, policies=policies, api_tokens=api_tokens, diagnosis=diagnosis)
    app.include_router(policy_routes.router)
    app.include_router(records.router)
    app.include_router(alerts.router)
    app.include_router(overview.router)
    app.include_router(fleet.router)
    app.include_router(fidelity.router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz(response: Response) -> dict:
        """Ready to serve: the engine runs (an engine's /v1 keeps serving through a database outage,
        its records spooled), or for the control plane alone, its database answers."""
        database = await _database_state(db)
        if engine is None:
            if database != "up":
                response.status_code = 503
            return {"ready": database == "up", "engine": None, "database": database}
        if not engine.running:
            response.status_code = 503
        return {
            "ready": engine.running and openai is not None and openai.app is not None,
            "model": engine.model_name,
            "speculation": engine.active_config.method,
            "draft_model": engine.active_config.draft_model,
            "capacity": engine.capacity,
            "settings_version": engine.settings.version,
            "degraded_reason": engine.degraded_reason,
            "database": database,
        }

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeoutError)
    async def database_unavailable(_: Request, exc: Exception) -> JSONResponse:
        reason = f"database unavailable ({type(getattr(exc, 'orig', None) or exc).__name__}); retry later"
        return JSONResponse({"detail": reason}, status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(DataError)
    async def database_refused(_: Request, exc: DataError) -> JSONResponse:
        detail = [{"loc": ["body"], "msg": f"the database refused a value: {exc.orig}", "type": "value_error"}]
        return JSONResponse({"detail": detail}, status_code=422)

    if engine is not None:  # what spectune does not route is vLLM's (/v1, /health, /tokenize, ...)
        app.add_middleware(_VllmRoutes, openai=openai)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes)  # outermost: before any route
    return app


async def _database_state(db: Engine) -> str:
    """ "up", or why not; never waits longer than the database's own timeout (``make_engine``)."""

    def ping() -> None:
        with db.connect() as conn:
            conn.execute(text("SELECT 1"))

    try:
        await run_in_threadpool(ping)
    except (DBAPIError, PoolTimeoutError) as exc:
        return f"unavailable ({type(getattr(exc, 'orig', None) or exc).__name__})"
    return "up"


SPECTUNE_PATHS = ("/api/", "/metrics", "/healthz", "/readyz", "/docs", "/redoc", "/openapi.json")


class _VllmRoutes:
    """Sends every path spectune does not own to vLLM's server before spectune's router runs
    (matching each request against the control plane's routes cost ~1 % of a tiny engine's tokens/s)."""

    def __init__(self, app, openai: OpenAIServer) -> None:
        self.app, self.openai = app, openai

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and not scope["path"].startswith(SPECTUNE_PATHS):
            return await self.openai(scope, receive, send)
        return await self.app(scope, receive, send)
