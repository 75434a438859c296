"""POST /v1/completions: OpenAI's text completions, one engine request per prompt (each with `n` samples)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.protocol import GenerateRequest
from frontend.openai.errors import APIError
from frontend.openai.params import structured_output_field
from frontend.openai.responses import CompletionChunks, completion_response
from frontend.openai.schema import CompletionRequest, CompletionResponse
from frontend.openai.serving import State, stream_flags

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(req: CompletionRequest, request: Request, state: State) -> Response:
    """Complete a prompt (text or token ids) or a list of them, as JSON or as SSE chunks with stream=true.
    A 400 for echo, suffix, best_of > 1, an empty prompt list or a prompt the engine refuses."""
    model = state.model_name(req.model)
    if req.echo:
        raise APIError(400, "echo: not supported (the prompt is not returned with the completion)", param="echo")
    if req.suffix is not None:
        raise APIError(400, "suffix: not supported (no insertion after the completion)", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of: only 1 is supported", param="best_of")
    sampling = state.sampling(req)
    prompts: list[Any]
    if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
        prompts = [req.prompt]
    else:
        prompts = list(req.prompt)
    if not prompts:
        raise APIError(400, "prompt: must not be an empty list", param="prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    requests = []
    for i, p in enumerate(prompts):  # the engine's logs name each prompt's request by the reply's id
        gen = GenerateRequest(rid if len(prompts) == 1 else f"{rid}-{i}", sampling=sampling, stream=bool(req.stream),
                              add_special_tokens=req.add_special_tokens, max_tokens_within_context=True)
        if isinstance(p, str):
            gen.prompt = p
        else:
            gen.prompt_token_ids = list(p)
        requests.append(gen)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model}
    choices = state.choices(len(prompts), sampling)
    writer = CompletionChunks(head, choices, *stream_flags(req))
    return await state.run(request, requests, bool(req.stream), "prompt",
                           lambda outs: completion_response(head, outs, choices), writer, structured_output_field(req))
