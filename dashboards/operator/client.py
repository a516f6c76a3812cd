"""The dashboard's only way to the data: spectune's REST API, with a token.

Errors come back as ``ApiError`` carrying the API's own words (FastAPI's
``detail``, validation errors as ``loc: msg``), so pages can show exactly what
the API said and never a stack trace.
"""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def _message(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text or response.reason_phrase
    if isinstance(detail, list):
        return "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', []) if p != 'body')}: {d.get('msg')}"
            if isinstance(d, dict)
            else str(d)
            for d in detail
        )
    return str(detail)


class Api:
    def __init__(self, base_url: str, token: str | None, timeout: float = 15.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the spectune API at {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError(response.status_code, _message(response))
        return response

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None}).json()

    def policy(self) -> tuple[dict[str, Any], str]:
        """(current policy version, its ETag)."""
        response = self.request("GET", "/api/v1/policy")
        return response.json(), response.headers["ETag"]

    def write_policy(self, method: str, body: dict[str, Any], etag: str, reason: str | None) -> dict[str, Any]:
        headers = {"If-Match": etag}
        if reason:
            headers["X-Change-Reason"] = reason
        return self.request(method, "/api/v1/policy", json=body, headers=headers).json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, json=body).json()
