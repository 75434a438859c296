"""POST /tokenize and /detokenize: the engine's tokenizer (the frontend's: this process holds none)."""

from __future__ import annotations

from fastapi import APIRouter

from common.protocol import GenerateRequest
from frontend.openai.errors import APIError
from frontend.openai.schema import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from frontend.openai.serving import State, chat_messages

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(req: TokenizeRequest, state: State) -> TokenizeResponse:
    """The token ids of a prompt, or of chat messages (and their tools) after the chat template; a 400 for both or
    neither, or for a prompt the frontend refuses."""
    state.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    gen = GenerateRequest("tokenize", prompt=req.prompt,
                          messages=None if req.messages is None else chat_messages(req.messages),
                          add_generation_prompt=req.add_generation_prompt,
                          add_special_tokens=req.add_special_tokens, tools=tools)
    result = await state.ask(state.client.tokenize(gen))
    if result.error is not None:
        param = "tools" if result.error.startswith("tools") else "prompt" if req.prompt is not None else "messages"
        raise APIError(400, result.error, param=param)
    return TokenizeResponse(count=len(result.token_ids), max_model_len=state.engine_info().max_model_len,
                            tokens=result.token_ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, state: State) -> DetokenizeResponse:
    """The text of token ids; a 400 for an id outside the vocabulary."""
    state.model_name(req.model)
    result = await state.ask(state.client.detokenize(req.tokens))
    if result.error is not None:
        raise APIError(400, result.error, param="tokens")
    return DetokenizeResponse(prompt=result.text)
