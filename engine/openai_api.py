"""OpenAI-compatible HTTP serving for the embedded engine (FastAPI).

``/v1/completions``, ``/v1/chat/completions`` (plain and SSE streaming) and
``/v1/models``.  Every error leaves in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` so official clients raise
their usual exceptions; bad input is a 4xx and the engine keeps serving.

spectune extension: ``spectune_class`` in the body (or the
``X-Spectune-Class`` header) picks the prompt class explicitly.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .core import Delta, EngineUnavailableError, GenerationRequest, InvalidRequestError, SpecEngine


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error from /v1 in OpenAI's format (other routes keep FastAPI's)."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": jsonable_encoder(exc.errors())}, status_code=422)
        return _error_response(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(exc.status_code, str(exc.detail), type_)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: Literal[1] = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    spectune_class: str | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def build_router(engine: SpecEngine, api_key: str | None = None) -> APIRouter:
    def authorize(authorization: Annotated[str | None, Header()] = None) -> None:
        if api_key is None:
            return
        token = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise OpenAIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    router = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def check_model(name: str) -> None:
        if name != engine.config.name:
            raise OpenAIError(
                404,
                f"the model '{name}' does not exist; served: {engine.config.name}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def to_generation(
        body: _SamplingFields, prompt: str | list[int], max_tokens: int | None, header_class: str | None
    ) -> GenerationRequest:
        is_ids = isinstance(prompt, list)
        # OpenAI's defaults: 16 tokens for completions, the rest of the context for chat.
        default_max = 16 if isinstance(body, CompletionRequest) else None
        return GenerationRequest(
            prompt=None if is_ids else prompt,
            prompt_token_ids=prompt if is_ids else None,
            max_tokens=max_tokens if max_tokens is not None else default_max,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop or [],
            ignore_eos=body.ignore_eos,
            prompt_class=body.spectune_class or header_class,
        )

    async def start(req: GenerationRequest) -> tuple[Delta | None, AsyncIterator[Delta]]:
        """Run up to the first delta so that input errors surface as 4xx, not mid-stream."""
        stream = engine.generate(req)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return None, stream
        except InvalidRequestError as exc:
            raise OpenAIError(400, str(exc), "invalid_request_error", exc.param, exc.code) from exc
        except EngineUnavailableError as exc:
            raise OpenAIError(503, str(exc), "server_error", code="engine_unavailable") from exc
        return first, stream

    async def collect(first: Delta | None, stream: AsyncIterator[Delta]) -> tuple[str, int, int, str]:
        parts, tokens, reason, prompt_tokens = [], 0, "stop", 0
        delta = first
        while delta is not None:
            parts.append(delta.text)
            tokens += len(delta.token_ids)
            reason = delta.finish_reason or reason
            prompt_tokens = delta.prompt_tokens
            delta = await anext(stream, None)
        return "".join(parts), tokens, prompt_tokens, reason

    def sse(first: Delta | None, stream: AsyncIterator[Delta], chunk) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            delta = first
            try:
                while delta is not None:
                    yield f"data: {json.dumps(chunk(delta))}\n\n"
                    delta = await anext(stream, None)
            except Exception as exc:
                yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n"
            finally:
                await stream.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": engine.config.name, "object": "model", "created": 0, "owned_by": "spectune"}],
        }

    @router.post("/completions")
    async def completions(body: CompletionRequest, x_spectune_class: Annotated[str | None, Header()] = None):
        check_model(body.model)
        first, stream = await start(to_generation(body, body.prompt, body.max_tokens, x_spectune_class))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: Delta) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [{"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}],
            }

        if body.stream:
            return sse(first, stream, chunk)
        text, tokens, prompt_tokens, reason = await collect(first, stream)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
            "usage": _usage(prompt_tokens, tokens),
        }

    @router.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, x_spectune_class: Annotated[str | None, Header()] = None):
        check_model(body.model)
        prompt = engine.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens
        first, stream = await start(to_generation(body, prompt, max_tokens, x_spectune_class))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        sent_role = False

        def chunk(delta: Delta) -> dict:
            nonlocal sent_role
            message = {"content": delta.text} if sent_role else {"role": "assistant", "content": delta.text}
            sent_role = True
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [{"index": 0, "delta": message, "finish_reason": delta.finish_reason}],
            }

        if body.stream:
            return sse(first, stream, chunk)
        text, tokens, prompt_tokens, reason = await collect(first, stream)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}],
            "usage": _usage(prompt_tokens, tokens),
        }

    return router


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
