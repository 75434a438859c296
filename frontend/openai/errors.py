"""The HTTP API's errors: `APIError`, OpenAI's error JSON, and the handlers that turn every failure into one.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`: 400 for a bad field or a prompt
the engine refuses, 401 for a missing or wrong API key (`guard.py`), 404 for an unknown model or route, 405 for a
method a route does not take, 413 for a body over the size limit (`guard.py`), 500 for a bug (logged, never sent
as a traceback), 503 while the engine starts, is overloaded or goes down. A body pydantic refuses is a 400 naming
the first bad field by its path ("messages[0].content"), what is wrong and the value given. The connection itself
(`connection.py`) answers 408 for a request too slow to arrive and 503 for a connection beyond the cap.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("deltaserve.http")


class APIError(Exception):
    """An error answered to the client as OpenAI's error JSON with HTTP status `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a JSON response with its status."""
        return JSONResponse(self.body(), status_code=self.status)


def unavailable(why: str | None) -> APIError:
    """The 503 of an engine that does not serve (yet): `why` is the client's reason, None while it starts."""
    return APIError(503, why or "the engine is starting: try again in a moment", "server_error",
                    code="engine_unavailable")


def install_error_handlers(app: FastAPI) -> None:
    """Answer `APIError`, refused bodies, Starlette's 404/405 and any other exception of `app` as OpenAI's JSON."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()), request.headers.get("content-type", ""))
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (see /docs)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message, code=None).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error answering %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__}); the server log has the details",
                        "server_error").response()


# ---------------------------------------------------------------------------------------------- validation messages
def validation_message(errors: list[dict[str, Any]], content_type: str = "") -> tuple[str, str | None]:
    """(message, param) for pydantic's errors about a request body: the first bad field, its path
    ("messages[0].content"), what is wrong and the value given. `content_type`: the request's header, named
    where a body that was not sent as JSON is why it is no JSON object (FastAPI parses only a JSON body)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {why}".rstrip(": "), None
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") == "missing":
        return "the request body is empty: send a JSON object", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        if content_type and "json" not in content_type:
            return ("the request body must be a JSON object sent with Content-Type: application/json, got "
                    f"Content-Type: {content_type[:100]}"), None
        return "the request body must be a JSON object", None
    path, tags = _path(loc)
    if tags:  # a union: pydantic reports one error per alternative, each under its alternative's tag
        field = path.split(".")[0].split("[")[0]
        kinds: list[str] = []
        by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for e in errors:
            sub_path, sub_tags = _path([p for p in e.get("loc", ()) if p != "body"])
            if sub_path.split(".")[0].split("[")[0] == field and sub_tags:
                if sub_tags[0] not in kinds:
                    kinds.append(sub_tags[0])
                by_kind.setdefault(sub_tags[0], []).append((sub_path, e))
        # An alternative whose shape fits and only some values do not (a token id of -3 in a list of ids):
        # the client meant that one, so its first wrong value is named, with its index.
        for kind in kinds:
            if all(not _is_type_error(e) for _, e in by_kind[kind]):
                sub_path, e = by_kind[kind][0]
                return f"{sub_path}: {e.get('msg', 'invalid value')}{_got(e)}", field
        accepted = " or ".join(k.replace("constrained-int", "token id").replace("constrained-float", "number")
                               for k in kinds)
        given = _given(first) or ("an object " if isinstance(first.get("input"), dict) else "")  # not quoted back
        return f"{field}: {given}is none of the accepted types ({accepted})", field
    if first.get("type") == "extra_forbidden":
        return f"{path}: unknown field (this server refuses fields it does not know)", path
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")  # a validator's own message
    return f"{path}: {message}{_got(first)}", path.split(".")[0].split("[")[0]


def _is_type_error(error: dict[str, Any]) -> bool:
    """Whether pydantic refused a value for its JSON type (a string for an int, a list for a string), rather than
    for its value (an int below the minimum)."""
    kind = str(error.get("type", ""))
    return kind.endswith("_type") or kind in ("missing", "is_instance_of", "union_tag_invalid")


def _path(loc: list[Any]) -> tuple[str, list[str]]:
    """A field path from a pydantic error location, and the union alternatives named in it."""
    out, tags = "", []
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or "-" in part or part in ("str", "int", "float", "bool", "list", "dict", "none"):
            tags.append(part)
        else:
            out += f".{part}" if out else part
    return out or "body", tags


def _got(error: dict[str, Any]) -> str:
    """", got VALUE" for the value pydantic refused (JSON, cut at 80 characters); "" for a missing one or an object."""
    value = error.get("input")
    if error.get("type") == "missing" or isinstance(value, dict):
        return ""
    text = json.dumps(value) if isinstance(value, (int, float, str, bool, list)) or value is None else repr(value)
    return f", got {text[:80]}{'...' if len(text) > 80 else ''}"


def _given(error: dict[str, Any]) -> str:
    """The refused value followed by a space ("5 "), or "" where `_got` names none."""
    got = _got(error)
    return f"{got[6:]} " if got else ""
