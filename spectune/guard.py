"""The request guard: what every request passes before any route runs.

* A body larger than ``max_body_bytes`` is refused with 413 as soon as that many
  bytes arrived (a Content-Length above it before any is read); nothing parses it.
* On the control-plane API (``/api/``), text the database cannot store is a 422
  up front instead of a 500 from the driver: NUL characters (PostgreSQL text
  refuses them) in the query string or the JSON body, and lone UTF-16 surrogates.
  (``/v1`` is vLLM's: its prompts may hold NUL; the recorder dead-letters what the
  database refuses.  Lone surrogates there are refused by ``OpenAIServer``.)

Errors come in the route family's shape: ``{"error": {...}}`` (vLLM's) outside
``/api/``, ``{"detail": ...}`` (FastAPI's) inside.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote_to_bytes

from spectune.engine.asgi import BodyTooLarge, has_lone_surrogate, json_leaves, read_body, replay, send_json

API_PREFIX = "/api/"


def _error(path: str, status: int, message: str, kind: str) -> tuple[int, bytes]:
    if path.startswith(API_PREFIX):
        detail: Any = [{"loc": ["body" if kind == "body" else "query"], "msg": message, "type": "value_error"}]
        if status == 413:
            detail = message
        return status, json.dumps({"detail": detail}).encode()
    error_type = HTTPStatus(status).phrase.title().replace(" ", "") + "Error"  # as vLLM names its types
    error = {"message": message, "type": error_type, "param": None, "code": status}
    return status, json.dumps({"error": error}).encode()


class RequestGuard:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        too_large = f"request body over {self.max_body_bytes} bytes (SPECTUNE_MAX_BODY_BYTES)"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await send_json(send, *_error(path, 413, too_large, "body"))
        if path.startswith(API_PREFIX) and b"\x00" in unquote_to_bytes(scope.get("query_string", b"")):
            return await send_json(send, *_error(path, 422, "NUL characters are not accepted", "query"))
        try:
            body, complete = await read_body(receive, self.max_body_bytes)
        except BodyTooLarge:
            return await send_json(send, *_error(path, 413, too_large, "body"))
        if path.startswith(API_PREFIX) and body and (problem := _unstorable(body)):
            return await send_json(send, *_error(path, 422, problem, "body"))
        await self.app(scope, replay(body, complete, receive), send)


def _unstorable(body: bytes) -> str | None:
    if b"\\u0000" not in body and b"\x00" not in body and b"\\ud" not in body and b"\\uD" not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None  # not JSON: the route says so itself
    if has_lone_surrogate(data):
        return "the body has a lone UTF-16 surrogate escape: not valid Unicode text"
    if any(isinstance(v, str) and "\x00" in v for v in json_leaves(data)):
        return "NUL characters are not accepted"
    return None
