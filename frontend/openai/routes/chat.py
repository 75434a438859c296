"""POST /v1/chat/completions: OpenAI's chat completions, one engine request (with `n` samples) per call; the
frontend applies the model's chat template (with the request's tools), and each sample's text is read into
OpenAI's message (reasoning, content, tool calls) by `frontend/chat_output.py`."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.protocol import GenerateRequest
from frontend.openai.errors import APIError
from frontend.openai.params import structured_output_field
from frontend.openai.responses import ChatChunks, chat_response
from frontend.openai.schema import ChatCompletionRequest, ChatCompletionResponse
from frontend.openai.serving import State, chat_messages, stream_flags
from frontend.tools import tool_constraint

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State) -> Response:
    """Answer chat messages, as JSON or as SSE chunks with stream=true: text, reasoning (with a reasoning parser)
    and tool calls (with tools). A 400 for echo, a tool choice this server cannot run, or messages the engine
    refuses."""
    model = state.model_name(req.model)
    if req.echo:
        raise APIError(400, "echo: not supported", param="echo")
    tools, tool_choice = state.tool_choice(req)
    sampling = state.sampling(req)
    structured_param = structured_output_field(req)
    if tool_choice is not None and tool_choice.forced:
        assert tools is not None
        sampling["structured_outputs"] = tool_constraint(tools, tool_choice)
        structured_param = "tools"  # a parameters schema the grammar library refuses is the tools' fault
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    gen = GenerateRequest(rid, messages=chat_messages(req.messages), sampling=sampling,  # the engine logs name rid
                          stream=bool(req.stream), add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message,
                          chat_template_kwargs=req.chat_template_kwargs or {},
                          add_special_tokens=req.add_special_tokens,
                          # without max_tokens a chat request may use the rest of the context (OpenAI's default)
                          max_tokens_within_context=bool(req.max_completion_tokens or req.max_tokens), tools=tools)
    choices = state.choices(1, sampling)
    reader = state.chat_reader(tool_choice)
    writer = ChatChunks({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "system_fingerprint": None}, choices, *stream_flags(req), reader=reader)
    head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
    return await state.run(request, [gen], bool(req.stream), "messages",
                           lambda outs: chat_response(head, outs[0], choices, reader), writer, structured_param)
