"""``/v1``: vLLM's own OpenAI-compatible server, on the embedded engine.

vLLM builds the app (``build_app``: its routers, error handlers and
middleware, ``--api-key`` included) and its serving state
(``init_app_state``) exactly as ``vllm serve`` does, over
``SpectuneEngineClient``.  ``OpenAIServer`` is the ASGI app spectune hands
every path it does not own (``spectune/app.py``): it answers 503 until the engine is up, rebuilds vLLM's
state after every engine (re)start, holds requests while the engine
rebuilds, and reads the prompt class a request
asks for (``engine/requests.py``) -- an unknown class is a 400 in vLLM's
error shape before anything runs.  It also refuses lone UTF-16 surrogates
(vLLM answers some with a 500), and gives every generation request an
``X-Request-Id`` (the client's, checked, or a new one) that vLLM turns into the
response id -- the record id -- and that comes back as a response header.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import uuid
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError

from .asgi import has_huge_int, has_lone_surrogate, read_body, replay, send_json, with_header
from .classifier import UnknownClassError
from .client import SpectuneEngineClient
from .requests import CLASS_HEADER, REQUEST_CONTEXT, RequestContext
from .schema import CLASS_ARG

if TYPE_CHECKING:
    from .core import SpecEngine

log = logging.getLogger(__name__)

_JSON_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
REQUEST_ID_HEADER = b"x-request-id"
# vLLM makes the response id (and spectune the record id) "cmpl-<X-Request-Id>": keep it storable.
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,96}")


class EngineDeathPolicy:
    """What vLLM's error handlers call ``app.state.server``: in ``vllm serve`` they set uvicorn's
    ``should_exit`` when the engine is dead, so that a supervisor restarts the process.  Here a
    speculative engine that dies comes back target-only (``SpecEngine._on_engine_error``); only a
    dead engine without speculation ends the process, by the SIGTERM uvicorn shuts down on."""

    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self.exit_requested = False

    @property
    def should_exit(self) -> bool:
        return self.exit_requested

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value and not self.exit_requested and self.engine.active_config.method == "none":
            self.exit_requested = True
            log.error("the engine died and cannot recover: stopping the server (SIGTERM)")
            os.kill(os.getpid(), signal.SIGTERM)


def _error(message: str | Exception, **kw: Any) -> tuple[int, bytes]:
    """(status, body) of vLLM's own error response for ``message``."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    response = create_error_response(message, **kw)
    return response.error.code, response.model_dump_json().encode()


def _prompt_count(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


class OpenAIServer:
    """ASGI app: vLLM's OpenAI server for ``engine``, with spectune's prompt class."""

    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self.client = SpectuneEngineClient(engine)
        self.app: Any = None
        engine.start_listeners.append(self.rebind)

    async def rebind(self) -> None:
        """vLLM's app and state for the engine that just started (renderers belong to one AsyncLLM)."""
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        args = self.engine.server_args
        tasks = await self.client.get_supported_tasks()
        app = build_app(args, tasks, self.client.model_config)
        await init_app_state(self.client, app.state, args, tasks)
        app.state.server = EngineDeathPolicy(self.engine)
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # the outer app's lifespan owns start-up
            return
        if self.app is None or (not self.engine.started and not self.engine.rebuilding):
            if scope["type"] != "http":
                return
            status = HTTPStatus.SERVICE_UNAVAILABLE
            unavailable = _error("engine is not running", err_type="ServiceUnavailableError", status_code=status)
            return await send_json(send, *unavailable)
        async with self.engine.admitted():  # a managed rebuild holds requests and drains these
            token = REQUEST_CONTEXT.set(RequestContext(admitted=True))
            try:
                await self._serve(scope, receive, send)
            finally:
                REQUEST_CONTEXT.reset(token)

    async def _serve(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body, more = await read_body(receive)
        if problem := _unservable(body):
            return await send_json(send, *_error(VLLMValidationError(problem)))
        if scope["path"] not in _JSON_ROUTES:
            return await self.app(scope, replay(body, more, receive), send)
        headers = dict(scope["headers"])
        request_id = headers.get(REQUEST_ID_HEADER)
        if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
            error = VLLMValidationError("X-Request-Id must be 1-96 of A-Z a-z 0-9 . _ : -", parameter="X-Request-Id")
            return await send_json(send, *_error(error))
        header_class = headers.get(CLASS_HEADER.encode())
        context, rewritten, error = self._context(body, header_class.decode("latin-1") if header_class else None)
        if error is not None:
            return await send_json(send, *error)
        scope = dict(scope, headers=list(scope["headers"]))
        if request_id is None:  # vLLM names the response (and spectune the record) after this header
            request_id = uuid.uuid4().hex.encode()
            scope["headers"].append((REQUEST_ID_HEADER, request_id))
        if rewritten is not None:
            body = rewritten
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope["headers"].append((b"content-length", str(len(body)).encode()))
        token = REQUEST_CONTEXT.set(dataclasses.replace(context, admitted=True))
        try:
            await self.app(scope, replay(body, more, receive), with_header(send, REQUEST_ID_HEADER, request_id))
        finally:
            REQUEST_CONTEXT.reset(token)

    def _context(
        self, body: bytes, header_class: str | None
    ) -> tuple[RequestContext, bytes | None, tuple[int, bytes] | None]:
        """(context, body without spectune's field or None, error or None)."""
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # vLLM answers malformed JSON itself
        if not isinstance(data, dict):
            return RequestContext(header_class), None, None
        rewritten = None
        if CLASS_ARG in data:  # vLLM would warn of an unknown field on every request
            chosen = data.pop(CLASS_ARG)
            rewritten = json.dumps(data).encode()
        else:
            chosen = None
        xargs = data.get("vllm_xargs")
        if chosen is None and isinstance(xargs, dict):
            chosen = xargs.get(CLASS_ARG)
        if chosen is None:
            chosen = header_class
        if chosen is not None:
            try:
                self.engine.classifier.known(chosen)
            except UnknownClassError as exc:
                return RequestContext(), None, _error(VLLMValidationError(str(exc), parameter=CLASS_ARG))
        single = data.get("prompt") is not None and _prompt_count(data) == 1
        return RequestContext(chosen, single_prompt_completion=single), rewritten, None


_LONG_NUMBER = re.compile(rb"[0-9]{19,}")


def _unservable(body: bytes) -> str | None:
    """What vLLM would answer with a 500 although the client is at fault (parsed only when the
    bytes hint at it: a \\uD8-\\uDF escape, a number of 19 or more digits)."""
    surrogate = b"\\ud" in body or b"\\uD" in body
    long_number = _LONG_NUMBER.search(body) is not None
    if not (surrogate or long_number):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None  # not JSON: vLLM answers that itself
    if surrogate and has_lone_surrogate(data):
        return "the request has a lone UTF-16 surrogate escape: not valid Unicode text"
    if long_number and has_huge_int(data):
        return "the request has an integer outside the signed 64-bit range"
    return None
