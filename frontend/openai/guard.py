"""The guard in front of every route: the API key (401) and the request-body size limit (413), both answered
before the body is read or parsed, so neither a stranger nor an oversized body reaches FastAPI."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from frontend.openai.errors import APIError
from frontend.openai.serving import ServerState

# Routes outside /v1 that need the API key too: a profiling session writes files on the server and slows it.
KEYED_ROUTES = frozenset({"/start_profile", "/stop_profile"})


class GuardMiddleware:
    """Pure ASGI middleware: the API key on /v1 routes and the profiling routes (401) and the request-body
    size limit (413, `state.max_body_bytes`). A chunked body is read here up to the limit and handed on whole."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.bearer = f"Bearer {state.api_key}".encode() if state.api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.bearer is not None and (scope["path"].startswith("/v1") or scope["path"] in KEYED_ROUTES):
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self.bearer):
                what = "wrong" if given else "missing"
                err = APIError(401, f"{what} API key: send the header 'Authorization: Bearer <key>' with the key "
                                    "the server was started with (--api-key or DELTASERVE_API_KEY)",
                               code="invalid_api_key")
                return await err.response()(scope, receive, send)
        limit = self.state.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:  # the HTTP parser holds the client to it: no more than this is read
            if not length.isdigit() or int(length) > limit:
                return await self._too_large(scope, receive, send, length.decode("latin-1"))
            return await self.app(scope, receive, send)
        # A chunked body: read it here, up to the limit, and hand it on whole.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._too_large(scope, receive, send, f"more than {limit}")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any, size: str) -> None:
        limit = self.state.max_body_bytes
        err = APIError(413, f"the request body has {size} bytes; at most {limit} are accepted "
                            f"(DELTASERVE_HTTP_MAX_BODY_MB={limit / (1 << 20):g})", code="request_too_large")
        await err.response()(scope, receive, send)
