"""From a route to the engine and back: the server's state and the plumbing every generating route shares.

A route reaches its `ServerState` through FastAPI's dependency mechanism (`State`, read from
`request.app.state.server`), never through a module global, so several apps can serve in one process. The
state checks the model asked for, maps a request's fields to `SamplingParams` (`params.py`), submits one
`GenerateRequest` per prompt and answers with the final outputs as JSON or streams them as Server-Sent Events
(`responses.py` writes bodies and chunks). A request the engine refuses becomes an `APIError` (`engine_error`),
also when streaming: a stream starts only once every prompt has its first output. A client that disconnects
has its requests aborted at once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from common.protocol import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    ERROR_OVERLOADED,
    NOT_RUN,
    EngineInfo,
    GenerateRequest,
    RequestOutput,
)
from common.sampling_params import SamplingParams
from frontend.async_client import AsyncEngineClient, EngineUnavailable, RequestStream, merge_outputs
from frontend.chat_output import ChatOutputReader
from frontend.openai.errors import APIError, unavailable
from frontend.openai.params import UnsupportedField, sampling_params, structured_output_field
from frontend.openai.responses import SSE_DONE, Choices, ChunkWriter, sse
from frontend.openai.schema import ChatCompletionRequest, ChatMessage, CompletionRequest
from frontend.reasoning_parsers import get_reasoning_parser
from frontend.tools import ToolChoice, ToolRequestError, resolve_tool_choice

SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
# Request fields the engine's refusals may start with, beside the sampling ones: the field named is the one blamed
ENGINE_NAMED_FIELDS = SAMPLING_FIELDS | {"tools"}
AUTO_TOOL_CHOICE_FLAGS = "a server started with --enable-auto-tool-choice and --tool-call-parser NAME (vLLM's flags)"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected while its request ran."""


@dataclass
class ServerState:
    """What the routes of one app share: the engine client and the guard's settings.

    `client` must be started in the event loop that serves the app. `api_key`: the key /v1 and the profiling
    routes require (None: no key needed). `max_body_bytes`: the largest request body accepted (bytes).
    """

    client: AsyncEngineClient
    api_key: str | None = None  # None: no key needed
    max_body_bytes: int = 16 << 20
    version: str = "unknown"
    tool_call_parser: str | None = None  # --tool-call-parser: how tool_choice "auto" reads outputs
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" is allowed
    reasoning_parser: str | None = None  # the engine's --reasoning-parser: chat outputs split off their reasoning

    def engine_info(self) -> EngineInfo:
        """The engine's info; raises a 503 `APIError` while the engine starts or once it goes down."""
        if not self.client.serving:
            raise unavailable(self.client.down_reason)
        assert self.client.info is not None
        return self.client.info

    def model_name(self, requested: str | None) -> str:
        """The name responses carry: the first served name (vLLM's rule), whichever of them was asked for.
        Raises a 404 `APIError` for a name not served (a 503 one while the engine does not serve)."""
        info = self.engine_info()
        names = info.served_model_names or [info.model]
        if requested is None or requested == "":
            return names[0]
        if requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist: this server serves "
                                f"{', '.join(repr(n) for n in names)}", param="model", code="model_not_found")
        return names[0]

    def sampling(self, req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """`req`'s `SamplingParams` as the dict a `GenerateRequest` carries; raises a 400 `APIError` for a field
        this server does not support or stream_options without stream=true."""
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
        try:
            return sampling_params(req, self.engine_info().max_model_len).to_dict()
        except UnsupportedField as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    def tool_choice(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, ToolChoice | None]:
        """The request's tools as the chat template takes them (None: none) and how it uses them (None: no tools);
        raises a 400 `APIError` naming `tools` or `tool_choice` for a choice this server cannot run (vLLM's rules,
        `frontend/tools.py`), or `response_format` and its kin beside a forced call."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
        try:
            resolved = resolve_tool_choice(tools, choice, req.parallel_tool_calls, self.tool_call_parser,
                                           self.enable_auto_tool_choice, AUTO_TOOL_CHOICE_FLAGS)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        constrained = structured_output_field(req)
        if resolved is not None and resolved.forced and constrained is not None:
            raise APIError(400, f"{constrained}: not with tool_choice {choice!r}, which constrains the output to the "
                                "calls' JSON itself: one constraint per request", param=constrained)
        return tools, resolved

    def chat_reader(self, tools: ToolChoice | None) -> Callable[[bool | None], ChatOutputReader]:
        """A factory of readers of one chat sample's output, given its `RequestOutput.prompt_reasoning`."""
        reasoning = get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        return lambda prompt_reasoning: ChatOutputReader(reasoning, prompt_reasoning, tools)

    def choices(self, num_prompts: int, sampling: dict[str, Any]) -> Choices:
        """The choice bookkeeping of `num_prompts` prompts with `sampling["n"]` samples each."""
        return Choices(num_prompts, sampling["n"], self.engine_info().info.get("eos_token_id"))

    async def ask(self, work: Awaitable[T]) -> T:
        """`await work` (one question to the engine: tokenize, stats, profiling); raises a 503 `APIError` if the
        engine is gone or does not answer in time."""
        try:
            return await work
        except (EngineUnavailable, TimeoutError) as exc:
            raise unavailable(str(exc) or "the engine did not answer in time") from None

    def submit(self, requests: list[GenerateRequest]) -> list[RequestStream]:
        """The prompts of one HTTP request go all or nothing: a refused one fails the call with a 400, so the others
        must not run (and count as successes) for an answer the client never gets."""
        try:
            return self.client.submit(requests, all_or_nothing=len(requests) > 1)
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None

    async def run(self, request: Request, requests: list[GenerateRequest], stream: bool, param: str,
                  respond: Callable[[list[RequestOutput]], dict[str, Any]], writer: ChunkWriter,
                  structured_param: str | None = None) -> Response:
        """Submit `requests` (one per prompt); answer with `respond(final outputs)` as JSON, or stream the
        chunks of `writer` as SSE. A request refused by the engine is an error status naming `param` (or
        the sampling field the engine names, or `structured_param` for a constraint the workers could not
        compile), also when streaming: the stream starts only once every request has produced its first
        output. A client that disconnects before the answer gets a 499 (nobody reads it) and its requests
        are aborted."""
        streams = self.submit(requests)
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


def server_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request` (a FastAPI dependency; `build_app` stores it)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]  # a route's parameter `state: State` receives it


def stream_flags(req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a request's stream_options."""
    options = req.stream_options
    return bool(options and options.include_usage), bool(options and options.continuous_usage_stats)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The chat template's input: text parts joined by newlines; OpenAI's "developer" role is a system one; an
    assistant's calls (`tool_calls`, arguments as JSON text: the frontend makes objects of them), its earlier
    reasoning (`reasoning_content`) and a tool message's `tool_call_id` go along, `refusal` does not."""
    out = []
    for m in messages:
        if m.content is None or isinstance(m.content, str):
            content = m.content
        else:
            content = "\n".join(part.text for part in m.content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


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
        if named is not None and named.group(0) in ENGINE_NAMED_FIELDS:
            return APIError(400, message, param=named.group(0))
        return APIError(400, f"{param if index is None else f'{param}[{index}]'}: {message}", param=param)
    if out.error_type == ERROR_ENGINE_DOWN:
        return unavailable(out.error)
    if out.error_type == ERROR_OVERLOADED:  # OpenAI's answer to an overloaded engine: 503, try again later
        return APIError(503, out.error or "the engine is overloaded", "server_error", code="engine_overloaded")
    return APIError(500, out.error or "the engine failed this request", "server_error")


def failed(out: RequestOutput) -> bool:
    """Whether the engine ended this request with an error (a refusal, or the engine going down)."""
    return out.error is not None or any(s.finish_reason == "error" for s in out.outputs)


# ---------------------------------------------------------------------------------------------- streams
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
    """The first output of every stream, in order."""
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
