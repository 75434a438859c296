"""POST /v1/chat/completions: OpenAI's chat completions, one engine request (with `n` samples) per call; the
frontend applies the model's chat template."""

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

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State) -> Response:
    """Answer chat messages, as JSON or as SSE chunks with stream=true. A 400 for echo, tools or messages the
    engine refuses."""
    model = state.model_name(req.model)
    if req.echo:
        raise APIError(400, "echo: not supported", param="echo")
    if req.tools or req.tool_choice not in (None, "none"):
        raise APIError(400, "tools: tool calling is not supported", param="tools" if req.tools else "tool_choice")
    sampling = state.sampling(req)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    gen = GenerateRequest(rid, messages=chat_messages(req.messages), sampling=sampling,  # the engine logs name rid
                          stream=bool(req.stream), add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message,
                          chat_template_kwargs=req.chat_template_kwargs or {},
                          add_special_tokens=req.add_special_tokens,
                          # without max_tokens a chat request may use the rest of the context (OpenAI's default)
                          max_tokens_within_context=bool(req.max_completion_tokens or req.max_tokens))
    choices = state.choices(1, sampling)
    writer = ChatChunks({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "system_fingerprint": None}, choices, *stream_flags(req))
    head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
    return await state.run(request, [gen], bool(req.stream), "messages",
                           lambda outs: chat_response(head, outs[0], choices), writer, structured_output_field(req))
