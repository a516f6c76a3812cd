"""Small ASGI helpers shared by vLLM's server wrapper and spectune's request guard."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


async def send_json(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def with_header(send: Any, name: bytes, value: bytes) -> Any:
    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start" and all(k.lower() != name for k, _ in message["headers"]):
            message = dict(message, headers=[*message["headers"], (name, value)])
        await send(message)

    return sending


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Any, limit: int | None = None) -> tuple[bytes, bool]:
    """(body, complete): complete is False when the client went away before the end.
    Raises ``BodyTooLarge`` as soon as more than ``limit`` bytes arrived (the rest is never read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge(size)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), True


def replay(body: bytes, complete: bool, receive: Any) -> Any:
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: disconnect detection

    return replayed if complete else receive


def has_lone_surrogate(value: Any) -> bool:
    """JSON may escape half of a UTF-16 pair ("\\ud800"): not text, and it fails later in the
    tokenizer or database as a 500.  Only called when the body has a \\uD8-\\uDF escape."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


INT64_MAX = 2**63 - 1


def json_leaves(value: Any) -> Iterator[Any]:
    """Every key and scalar of parsed JSON (the one walk the body checks share)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from json_leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from json_leaves(item)
    else:
        yield value


def has_huge_int(value: Any) -> bool:
    """An integer outside int64 anywhere in parsed JSON: vLLM turns some fields (``top_k``, ...) into
    C integers and fails with a 500 on them.  Only called when the body has a run of 19+ digits."""
    return any(
        isinstance(v, int) and not isinstance(v, bool) and not -INT64_MAX - 1 <= v <= INT64_MAX
        for v in json_leaves(value)
    )
