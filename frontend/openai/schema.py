"""The OpenAI API's request and response bodies, as pydantic models (FastAPI shows them at /docs).

Field names, defaults and ranges are OpenAI's (platform.openai.com/docs/api-reference), with vLLM's extra
sampling fields (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, ...). Requests refuse
unknown fields (a typo must not pass silently, where vLLM ignores it with a warning) and NaN or infinite numbers.
Which declared fields the engine runs is decided in `frontend/openai/params.py`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_LIMIT = 2**63  # token ids, counts and seeds travel as 64-bit integers

TokenId = Annotated[int, Field(ge=0, lt=INT64_LIMIT)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class RequestModel(BaseModel):
    # strict: a field of the wrong JSON type is a 400 naming it ("3" for max_tokens, "yes" for stream), as
    # OpenAI answers, not converted; an integer still passes for a number.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JSONSchemaFormat(RequestModel):
    """response_format.json_schema: OpenAI's named schema (`strict` is accepted: the engine is always strict)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True, strict=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # pydantic's own `schema`
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(RequestModel):
    """The sampling fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model
    frequency_penalty: Penalty | None = 0.0
    presence_penalty: Penalty | None = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    seed: Annotated[int, Field(ge=0, lt=INT64_LIMIT)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None  # None: 1.0; 0 = greedy
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None  # None: 1.0
    user: str | None = None  # accepted and logged nowhere
    # vLLM's extra sampling fields
    top_k: Annotated[int, Field(ge=-1, lt=INT64_LIMIT)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, lt=INT64_LIMIT)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # not with stream=true (vLLM)
    # OpenAI's structured output (vLLM takes it on completions too), and vLLM's structured-output fields
    # (frontend/openai/params.py: at most one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields: {"json": schema}, ...
    guided_json: dict[str, Any] | bool | str | None = None  # a JSON schema (true: any JSON document), or its text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # EBNF (GBNF)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a text, a list of texts, token ids, or a list of token-id lists;
    each prompt is one choice (index in order)."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    best_of: Annotated[int, Field(ge=1)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tokens: Annotated[int, Field(ge=1, lt=INT64_LIMIT)] | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens around each text prompt


class TextContent(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's)


class MessageToolCall(RequestModel):
    """A call an earlier assistant turn made (OpenAI's `tool_calls` entry)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    """A message of the conversation. `tool` messages answer an assistant's call (`tool_call_id`); an assistant
    message with `tool_calls` may have no content. `refusal` and `reasoning_content` are what a client sends back
    when it appends a whole response message (the openai package does): the first is ignored, the second is shown
    to templates that render earlier reasoning (Qwen3's)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContent] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant
    reasoning_content: str | None = None  # assistant

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id is required in a tool message (the id of the call it answers)")
        return self


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # accepted: forced calls always follow the schema


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """tool_choice naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: `messages` rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tokens: Annotated[int, Field(ge=1, lt=INT64_LIMIT)] | None = None  # OpenAI's older name
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT64_LIMIT)] | None = None
    tools: list[ChatTool] | None = None  # an empty list: no tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = None  # None: True
    # OpenAI's fields about its own platform (stored completions, their tags, the processing tier): accepted as the
    # openai client sends them, with nothing to do on this server
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extra chat fields
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": false}
    add_special_tokens: bool = False
    echo: bool = False


class TokenizeRequest(RequestModel):
    """POST /tokenize (vLLM's): the prompt's token ids, as a completion (`prompt`) or a chat (`messages`)
    request would run them."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None  # with messages: as a chat request renders them


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class StartProfileRequest(RequestModel):
    """POST /start_profile (vLLM's route; the body is optional): trace at most `num_steps` steps, 0 = as
    many as the engine's --profile-steps window holds."""

    num_steps: Annotated[int, Field(ge=0, lt=2**31)] = 0


# ---------------------------------------------------------------------------------------------- responses
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class Usage(ResponseModel):
    """Token counts: `prompt_tokens` counts each prompt once (whatever `n`), `completion_tokens` the tokens of
    every choice. `ttft_s` and `tpot_s` (seconds, as the engine measured them) are our extras, for debugging:
    with several prompts, the slowest first token and the mean time per output token."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None


class PromptLogprob(ResponseModel):
    """vLLM's entry for one token at a prompt position."""

    logprob: float  # natural log; -9999.0 stands for -inf
    rank: int  # 1 = the most likely token there
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: PromptLogprob} holding the
# prompt token and the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(ResponseModel):
    """OpenAI's (legacy) completion logprobs, one entry per output token: its text, its logprob, the most
    likely tokens there ({text: logprob}, the sampled token first, up to `logprobs` + 1 entries), and the
    character offset of the token in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int  # prompt index * n + sample index
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id; None at EOS or length
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class ResponseFunctionCall(ResponseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ResponseToolCall(ResponseModel):
    id: str  # chatcmpl-tool-<32 hex digits>
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # None when calls or reasoning took all of the output
    refusal: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the text inside <think>...</think>
    tool_calls: list[ResponseToolCall] | None = None


class TopLogprobEntry(ResponseModel):
    token: str
    logprob: float  # natural log; -9999.0 stands for -inf
    bytes: list[int] | None = None  # the token text's UTF-8 bytes


class TokenLogprob(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]  # the `top_logprobs` most likely tokens, most likely first


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None  # one entry per output token
    refusal: list[TokenLogprob] | None = None


class ChatChoice(ResponseModel):
    index: int  # the sample index, 0 .. n - 1
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", or "tool_calls" when it made calls
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id; None at EOS or length


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deltaserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str


class ProfileResponse(ResponseModel):
    """A profiling session: its number, its first and last step (the last is an upper bound until it
    stops), its folder, and once stopped the summary table (also in <folder>/summary.txt)."""

    session: int
    first_step: int
    last_step: int
    folder: str
    summary: str | None = None
