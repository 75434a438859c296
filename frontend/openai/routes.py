"""The OpenAI-compatible HTTP API: FastAPI routes over one `AsyncEngineClient`.

Each HTTP request becomes one engine request per prompt (`GenerateRequest`, with `n` samples), sent to
the frontend over ZeroMQ; the frontend tokenizes, validates and detokenizes (token texts of logprobs
included), so this process holds no tokenizer (the frontend is one process for every client, and keeping
tokenization there keeps one definition of a prompt's tokens; the HTTP process only parses JSON, maps
fields (`params.py`) and writes bodies and chunks (`responses.py`)). Streams are Server-Sent Events as
OpenAI sends them. A client that disconnects has its requests aborted at once. `/start_profile` and
`/stop_profile` (vLLM's routes) run the engine's profiling sessions.

Errors are OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad field or a
prompt the engine refuses, 401 for a missing or wrong API key on /v1 routes and the profiling routes, 404
for an unknown model or
route, 413 for a body over the size limit, 503 while the engine starts or goes down. Nothing a client
sends yields a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.protocol import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    ERROR_OVERLOADED,
    NOT_RUN,
    GenerateRequest,
    ProfileStatus,
    RequestOutput,
)
from common.sampling_params import SamplingParams
from frontend.async_client import AsyncEngineClient, EngineUnavailable, RequestStream, merge_outputs
from frontend.openai import metrics
from frontend.openai.params import UnsupportedField, sampling_params, structured_output_field
from frontend.openai.responses import (
    SSE_DONE,
    ChatChunks,
    Choices,
    ChunkWriter,
    CompletionChunks,
    chat_response,
    completion_response,
    sse,
)
from frontend.openai.schema import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ProfileResponse,
    StartProfileRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

log = logging.getLogger("deltaserve.http")
SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
# Routes outside /v1 that need the API key too: a profiling session writes files on the server and slows it.
KEYED_ROUTES = frozenset({"/start_profile", "/stop_profile"})


class APIError(Exception):
    """An error answered to the client as OpenAI's error JSON with HTTP status `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def unavailable(why: str | None) -> APIError:
    return APIError(503, why or "the engine is starting: try again in a moment", "server_error",
                    code="engine_unavailable")


@dataclass
class ServerState:
    client: AsyncEngineClient
    api_key: str | None = None  # None: no key needed
    max_body_bytes: int = 16 << 20
    version: str = "unknown"


class ClientGone(Exception):
    """The HTTP client disconnected while its request ran."""


# ---------------------------------------------------------------------------------------------- middleware
class GuardMiddleware:
    """Pure ASGI middleware: the API key on /v1 routes and the profiling routes (401) and the request-body
    size limit (413), both answered before the body is read or parsed."""

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


# ---------------------------------------------------------------------------------------------- errors
def _validation_message(errors: list[dict[str, Any]], content_type: str = "") -> tuple[str, str | None]:
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
    return f"{path}: {first.get('msg', 'invalid value')}{_got(first)}", path.split(".")[0].split("[")[0]


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
    value = error.get("input")
    if error.get("type") == "missing" or isinstance(value, dict):
        return ""
    text = json.dumps(value) if isinstance(value, (int, float, str, bool, list)) or value is None else repr(value)
    return f", got {text[:80]}{'...' if len(text) > 80 else ''}"


def _given(error: dict[str, Any]) -> str:
    got = _got(error)
    return f"{got[6:]} " if got else ""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()), request.headers.get("content-type", ""))
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


def engine_error(out: RequestOutput, param: str, structured_param: str | None = None,
                 index: int | None = None) -> APIError:
    """The HTTP error for a request the engine ended with an error. `param` is the field an invalid
    request is blamed on (the prompt), unless the engine's message starts with a sampling field's name
    ("n must be in [1, max_num_seqs=256] ...", "logit_bias keys must be token ids in [0, 151669) ...");
    a constraint the workers could not compile names `structured_param`, the request field that gave it.
    `index`: which of several prompts it was, named in the message ("prompt[1]: the prompt is empty")."""
    if out.error_type == ERROR_INVALID_REQUEST:
        message = out.error or "invalid"
        if structured_param is not None and message.startswith("structured_outputs"):
            named = message if message.startswith(structured_param) else f"{structured_param}: {message}"
            return APIError(400, named, param=structured_param)
        named = re.match(r"[a-z_]+", message)
        if named is not None and named.group(0) in SAMPLING_FIELDS:
            return APIError(400, message, param=named.group(0))
        return APIError(400, f"{param if index is None else f'{param}[{index}]'}: {message}", param=param)
    if out.error_type == ERROR_ENGINE_DOWN:
        return unavailable(out.error)
    if out.error_type == ERROR_OVERLOADED:  # OpenAI's answer to an overloaded engine: 503, try again later
        return APIError(503, out.error or "the engine is overloaded", "server_error", code="engine_overloaded")
    return APIError(500, out.error or "the engine failed this request", "server_error")


# ---------------------------------------------------------------------------------------------- helpers
async def wait_disconnect(request: Request) -> None:
    """Return when the HTTP client disconnects (the body has been read: the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`await work`, or raise `ClientGone` as soon as the client disconnects (cancelling `work`)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone
    return task.result()


async def first_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    return [await s.next_output() for s in streams]


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream (requests sent with stream=False have only that one)."""
    outs = []
    for s in streams:
        parts = [await s.next_output()]
        while not parts[-1].finished:  # defensive: a streamed request's deltas are joined
            parts.append(await s.next_output())
        outs.append(merge_outputs(parts))
    return outs


async def fan_in(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of several streams, as they come; ends when all have finished."""
    live = [(i, s) for i, s in enumerate(streams) if not s.finished]
    if len(live) == 1:
        i, s = live[0]
        async for out in s:
            yield i, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        async for out in s:
            queue.put_nowait((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in live]
    try:
        remaining = len(live)
        while remaining:
            i, out = await queue.get()
            remaining -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def failed(out: RequestOutput) -> bool:
    """Whether the engine ended this request with an error (a refusal, or the engine going down)."""
    return out.error is not None or any(s.finish_reason == "error" for s in out.outputs)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The chat template's input: text parts joined by newlines; OpenAI's "developer" role is a system one."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(part.text for part in m.content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def version() -> str:
    """deltaserve's version: the installed package's, else that of the checkout's pyproject.toml."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("deltaserve")
    except PackageNotFoundError:  # run from a checkout that was not installed
        pyproject = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")
        try:
            with open(pyproject, encoding="utf-8") as f:
                found = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
        except OSError:
            found = None
        return found.group(1) if found else "unknown"


# ---------------------------------------------------------------------------------------------- the app
def build_app(state: ServerState) -> FastAPI:
    """The ASGI application. `state.client` must be started in the event loop that serves the app."""
    app = FastAPI(title="deltaserve", summary="An OpenAI-compatible API over the deltaserve engine",
                  version=version(), responses={400: {"model": ErrorResponse}})
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)
    client = state.client

    def engine_info() -> Any:
        if not client.serving:
            raise unavailable(client.down_reason)
        assert client.info is not None
        return client.info

    def model_name(requested: str | None) -> str:
        """The name responses carry: the first served name (vLLM's rule), whichever of them was asked for.
        Raises a 404 `APIError` for a name not served."""
        info = engine_info()
        names = info.served_model_names or [info.model]
        if requested is None or requested == "":
            return names[0]
        if requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist: this server serves "
                                f"{', '.join(repr(n) for n in names)}", param="model", code="model_not_found")
        return names[0]

    def submit(requests: list[GenerateRequest]) -> list[RequestStream]:
        """The prompts of one HTTP request go all or nothing: a refused one fails the call with a 400, so the others
        must not run (and count as successes) for an answer the client never gets."""
        try:
            return client.submit(requests, all_or_nothing=len(requests) > 1)
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None

    def params_dict(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
        try:
            return sampling_params(req, engine_info().max_model_len).to_dict()
        except UnsupportedField as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    # ------------------------------------------------------------------ plain routes
    @app.get("/health", summary="200 once the engine serves; 503 while it starts or goes down")
    async def health() -> Response:
        if not client.serving:
            return unavailable(client.down_reason).response()
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def get_version() -> VersionResponse:
        return VersionResponse(version=app.version)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        info = engine_info()
        return ModelList(data=[ModelCard(id=n, root=n, max_model_len=info.max_model_len)
                               for n in info.served_model_names or [info.model]])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> ModelCard:
        model_name(model_id)  # a 404 unless served
        return ModelCard(id=model_id, root=model_id, max_model_len=engine_info().max_model_len)

    @app.get("/metrics", summary="Prometheus metrics (vLLM's names, prefix deltaserve:)")
    async def get_metrics() -> Response:
        info = engine_info()
        try:
            stats = await client.engine_stats()
        except (EngineUnavailable, TimeoutError) as exc:
            raise unavailable(str(exc) or "the engine did not answer in time") from None
        body, content_type = metrics.render(stats, info.model)
        return Response(body, media_type=content_type)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        gen = GenerateRequest("tokenize", prompt=req.prompt,
                              messages=None if req.messages is None else chat_messages(req.messages),
                              add_generation_prompt=req.add_generation_prompt,
                              add_special_tokens=req.add_special_tokens)
        try:
            result = await client.tokenize(gen)
        except (EngineUnavailable, TimeoutError) as exc:
            raise unavailable(str(exc) or "the engine did not answer in time") from None
        if result.error is not None:
            raise APIError(400, result.error, param="prompt" if req.prompt is not None else "messages")
        return TokenizeResponse(count=len(result.token_ids), max_model_len=engine_info().max_model_len,
                                tokens=result.token_ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        model_name(req.model)
        try:
            result = await client.detokenize(req.tokens)
        except (EngineUnavailable, TimeoutError) as exc:
            raise unavailable(str(exc) or "the engine did not answer in time") from None
        if result.error is not None:
            raise APIError(400, result.error, param="tokens")
        return DetokenizeResponse(prompt=result.text)

    # ------------------------------------------------------------------ generation
    async def run(request: Request, requests: list[GenerateRequest], stream: bool, param: str,
                  respond: Callable[[list[RequestOutput]], dict[str, Any]], writer: ChunkWriter,
                  structured_param: str | None = None) -> Response:
        """Submit `requests` (one per prompt); answer with `respond(final outputs)` as JSON, or stream the
        chunks of `writer` as SSE. A request refused by the engine is an error status naming `param` (or
        the sampling field the engine names, or `structured_param` for a constraint the workers could not
        compile), also when streaming: the stream starts only once every request has produced its first
        output."""
        streams = submit(requests)
        handed_over = False
        try:
            outs = await until_disconnect(request, first_outputs(streams) if stream else final_outputs(streams))
            bad = next((i for i, o in enumerate(outs) if failed(o) and not (o.error or "").startswith(NOT_RUN)),
                       next((i for i, o in enumerate(outs) if failed(o)), None))  # the refused one, not those it sank
            if bad is not None:
                raise engine_error(outs[bad], param, structured_param, bad if len(outs) > 1 else None)
            if not stream:
                return JSONResponse(respond(outs))
            handed_over = True
            return StreamingResponse(_closing(stream_events(streams, outs, writer, param), streams),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_over:
                for s in streams:
                    s.close()

    def choices_of(num_prompts: int, sampling: dict[str, Any]) -> Choices:
        return Choices(num_prompts, sampling["n"], engine_info().info.get("eos_token_id"))

    def stream_flags(req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) of a request's stream_options."""
        options = req.stream_options
        return bool(options and options.include_usage), bool(options and options.continuous_usage_stats)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        model = model_name(req.model)
        if req.echo:
            raise APIError(400, "echo: not supported (the prompt is not returned with the completion)", param="echo")
        if req.suffix is not None:
            raise APIError(400, "suffix: not supported (no insertion after the completion)", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError(400, "best_of: only 1 is supported", param="best_of")
        sampling = params_dict(req)
        prompts: list[Any]
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
            prompts = [req.prompt]
        else:
            prompts = list(req.prompt)
        if not prompts:
            raise APIError(400, "prompt: must not be an empty list", param="prompt")
        requests = []
        for p in prompts:
            gen = GenerateRequest(client.new_request_id(), sampling=sampling, stream=bool(req.stream),
                                  add_special_tokens=req.add_special_tokens, max_tokens_within_context=True)
            if isinstance(p, str):
                gen.prompt = p
            else:
                gen.prompt_token_ids = list(p)
            requests.append(gen)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model}
        choices = choices_of(len(prompts), sampling)
        writer = CompletionChunks(head, choices, *stream_flags(req))
        return await run(request, requests, bool(req.stream), "prompt",
                         lambda outs: completion_response(head, outs, choices), writer, structured_output_field(req))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        model = model_name(req.model)
        if req.echo:
            raise APIError(400, "echo: not supported", param="echo")
        if req.tools or req.tool_choice not in (None, "none"):
            raise APIError(400, "tools: tool calling is not supported", param="tools" if req.tools else "tool_choice")
        sampling = params_dict(req)
        gen = GenerateRequest(client.new_request_id(), messages=chat_messages(req.messages), sampling=sampling,
                              stream=bool(req.stream), add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message,
                              chat_template_kwargs=req.chat_template_kwargs or {},
                              add_special_tokens=req.add_special_tokens,
                              # without max_tokens a chat request may use the rest of the context (OpenAI's default)
                              max_tokens_within_context=bool(req.max_completion_tokens or req.max_tokens))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = choices_of(1, sampling)
        writer = ChatChunks({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "system_fingerprint": None}, choices, *stream_flags(req))
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
        return await run(request, [gen], bool(req.stream), "messages",
                         lambda outs: chat_response(head, outs[0], choices), writer, structured_output_field(req))

    # ------------------------------------------------------------------ profiling (vLLM's routes)
    @app.post("/start_profile", response_model=ProfileResponse,
              summary="Trace every engine process from the next step (the engine needs --profile-dir)")
    async def start_profile(req: StartProfileRequest | None = None) -> ProfileResponse:
        num_steps = req.num_steps if req is not None else 0
        return await profile_request(lambda: client.start_profile(num_steps))

    @app.post("/stop_profile", response_model=ProfileResponse,
              summary="Stop the trace after the last step planned; answers once the files are written and merged")
    async def stop_profile() -> ProfileResponse:
        return await profile_request(client.stop_profile)

    async def profile_request(ask: Callable[[], Awaitable[ProfileStatus]]) -> ProfileResponse:
        engine_info()
        try:
            status = await ask()
        except (EngineUnavailable, TimeoutError) as exc:
            raise unavailable(str(exc) or "the engine did not answer in time") from None
        if status.error is not None:
            raise APIError(400, status.error, code="profiling_refused")
        return ProfileResponse(session=status.session, first_step=status.first_step, last_step=status.last_step,
                               folder=status.folder, summary=status.summary or None)

    return app


async def stream_events(streams: list[RequestStream], firsts: list[RequestOutput], writer: ChunkWriter,
                        param: str) -> AsyncIterator[str]:
    """The SSE events of a streamed response: `writer`'s chunks for `firsts` (each stream's first output)
    and every later output, then its closing chunks and `[DONE]`. A request the engine ends with an error
    (it went down) adds an error event instead of its remaining chunks, and the usage chunk is left out."""
    errors = 0
    for event in writer.opening(firsts):
        yield event
    for i, out in enumerate(firsts):
        for event in writer.news(i, out):
            yield event
    async for i, out in fan_in(streams):
        if failed(out):
            errors += 1
            yield sse(engine_error(out, param).body())
            continue
        for event in writer.news(i, out):
            yield event
    if not errors:
        for event in writer.closing():
            yield event
    yield SSE_DONE


async def _closing(events: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """`events`, closing `streams` at the end: a client that disconnects mid-stream cancels this generator
    (Starlette listens for the disconnect), which aborts the requests still running."""
    try:
        async for event in events:
            yield event
    finally:
        for s in streams:
            s.close()
