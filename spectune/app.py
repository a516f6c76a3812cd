"""The HTTP application: engine serving plus health endpoints.

This is the one place where the engine is wired to its sinks (and, as the
control plane grows, to the store, API and tuner).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from spectune.engine.core import SpecEngine
from spectune.engine.openai_api import build_router, install_error_handlers


def create_app(engine: SpecEngine, openai_api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if not engine.started:  # tests may hand in a started engine
            await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="spectune", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(build_router(engine, openai_api_key))

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> dict:
        return {
            "ready": engine.running,
            "model": engine.config.name,
            "speculation": engine.active_config.method,
            "capacity": engine.capacity,
            "settings_version": engine.settings.version,
            "degraded_reason": engine.degraded_reason,
        }

    return app
