"""What a client's request becomes in the frontend: its prompt tokenized (a text, chat messages through the
chat template, or given token ids) and checked against the engine's limits, then split into the scheduler's
`EngineRequest` and the frontend's `RequestState`; or a `ValueError` saying why it is refused, which its
client gets as an error output while the other requests of the same submission go ahead.
"""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.config import EngineConfig
from common.errors import ExplainedError, quote, shorten
from common.limits import prompt_limit_error, token_id_range_error
from common.protocol import (
    EngineRequest,
    GenerateRequest,
    PositionLogprobs,
    SamplingOptions,
    Tokenize,
    TokenizeResult,
    i32,
)
from common.sampling_params import SamplingParams
from frontend.outputs import SampleState
from frontend.reasoning_parsers import ReasoningParser, get_reasoning_parser
from frontend.tools import ToolRequestError, tool_names

PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens decoded to see where it leaves the reasoning (prompt_reasoning)


def load_tokenizer(path: str) -> Any:
    """The fast tokenizer in folder `path`. Raises `ExplainedError` if there is none."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises several types for a folder without a tokenizer
        raise ExplainedError(f"cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise ExplainedError(f"the tokenizer in {path} has no fast (Rust) implementation, which the detokenizer needs")
    if len(tok) < 2:  # transformers builds an empty tokenizer for a folder without tokenizer files
        raise ExplainedError(f"no tokenizer in {path} (tokenizer.json, or vocab and merges files): "
                             f"pass --tokenizer DIR")
    return tok


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters any one token can stand for: a text longer than `max_model_len` times this
    has more than `max_model_len` tokens, so it is refused before it is tokenized."""
    return max(1, max(len(t) for t in tokenizer.get_vocab()))


def renders_tools(tokenizer: Any, tools: list[dict[str, Any]]) -> bool:
    """Whether the chat template the tokenizer would apply with `tools` shows them to the model: its text names
    `tools` (a template that never does renders the same prompt with or without them)."""
    try:
        template = tokenizer.get_chat_template(tools=tools)
    except Exception:  # no template at all: apply_chat_template says so
        return False
    return "tools" in template


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them (copies): an assistant message with `tool_calls` may have no
    content (it becomes ""), and its calls' `arguments`, JSON text on the wire (OpenAI's), become the objects
    templates expect (Qwen3's takes either, Llama 3.1's only objects: vLLM's conversion). Raises `ValueError` for
    a message without a role and text content, or arguments that are not a JSON object."""
    if not messages or not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls and m.get("content") is None:
            m["content"] = ""
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string, got {_shown(m.get('role'))}: messages must be "
                             "a non-empty list of {'role': str, 'content': str}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string, got {_shown(m.get('content'))} (an "
                             "assistant message with tool_calls may have no content)")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise ValueError(f"messages[{i}].tool_calls must be a list of calls, got {str(calls)[:80]}")
            m["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(m)
    return out


def _shown(value: Any) -> str:
    """A value as an error message names it: its type, and its text as `quote` cuts it."""
    return "nothing" if value is None else f"{type(value).__name__} {quote(str(value))}"


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                         f"'arguments': ...}}}}, got {str(call)[:80]}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except RecursionError:  # nested deeper than Python's stack: as much a bad argument as a syntax error
            raise ValueError(f"{where}.function.arguments is JSON nested too deeply: {arguments[:80]!r}") from None
        except ValueError as exc:
            raise ValueError(f"{where}.function.arguments is not JSON text ({exc}): {arguments[:80]!r}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, got {str(arguments)[:80]}")
    return {**call, "function": {**function, "arguments": arguments}}


def encode_prompt(tokenizer: Any, req: GenerateRequest, max_chars: int | None = None) -> list[int]:
    """Token ids of a request: `tokenizer(prompt)`, the chat template over `messages` (with the request's
    `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `tools`), or given ids.
    `req.add_special_tokens` (None: True for a prompt, False for messages, whose template writes its own).

    Raises `ValueError` if not exactly one of the three is set, one is malformed, the chat template
    refuses the messages (or its options contradict each other) or renders no tools when there are some
    (the message then starts with "tools"), or a text is longer than `max_chars` characters (checked
    before tokenizing).
    """
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise ValueError(f"a request needs exactly one of prompt, prompt_token_ids, messages; got {given or 'none'}")
    if req.tools and req.messages is None:
        raise ValueError("tools: only a chat request (messages) can carry tools")
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if req.prompt is not None:
        text, special = req.prompt, req.add_special_tokens is not False
    else:
        messages = template_messages(req.messages)
        tools: dict[str, Any] = {}
        if req.tools:
            try:
                tool_names(req.tools)
            except ToolRequestError as exc:
                raise ValueError(str(exc)) from None
            if not renders_tools(tokenizer, req.tools):
                raise ValueError("tools: the chat template of this model does not render tools (its text never "
                                 "names `tools`), so the model would not see them; serve a model whose template "
                                 "supports tool calling (Qwen3, Llama 3.1 and later, ...)")
            tools["tools"] = req.tools
        if req.add_generation_prompt and req.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true: the first "
                             "opens a new assistant turn, the second continues the last message")
        own = sorted(set(req.chat_template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
        if own:
            raise ValueError(f"chat_template_kwargs cannot set {own}: they are arguments of the template call, not "
                             "template variables")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final_message, tokenize=False,
                                                 **tools, **req.chat_template_kwargs)
        except Exception as exc:  # jinja TemplateError (raise_exception), TypeError, UndefinedError, ...
            why = f"the chat template refused these messages: {type(exc).__name__}: {exc}"
            raise ValueError(shorten(why)) from None
        special = bool(req.add_special_tokens)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the prompt has {len(text)} characters: more than max_model_len tokens for sure "
                         f"(at most {max_chars} characters can fit)")
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space (vLLM's rule: the spaced form counts only when
    it begins with another token and has as many tokens, i.e. a space-joined variant of the word), without
    repeats, in the words' order. One batched call of the tokenizer for all the words."""
    if not words:
        return []
    stripped = [w.lstrip() for w in words]
    encoded = tokenizer(stripped + [" " + w for w in stripped], add_special_tokens=False)["input_ids"]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for bare, spaced in zip(encoded[: len(words)], encoded[len(words):]):
        for ids in (bare, spaced) if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare) else (
                bare,):
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(list(ids))
    return out


def context_length_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int, where: str) -> str:
    """vLLM's words for a request whose prompt and max_tokens do not fit in the context together."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or completion.")


class PromptRejected(ValueError):
    """A tokenized prompt the engine cannot run; `num_prompt_tokens` is its length, reported to the client."""

    def __init__(self, message: str, num_prompt_tokens: int) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens


@dataclass
class RequestState:
    """The frontend's record of one accepted request, from validation until its last output is sent: whose it
    is, its samples' detokenizers and stop checks (`SampleState`), its timings (`time.time()` seconds) and
    counts (tokens)."""

    client: bytes
    request_id: str
    seq_id: int  # of sample 0; sample i has seq_id + i
    params: SamplingParams
    num_prompt_tokens: int
    samples: list[SampleState]
    arrival_time: float
    prompt_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None
    num_unfinished: int = 1
    queue_s: float | None = None  # sample 0's time from arrival to its first scheduling, once it finished
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # position 0 is None
    prompt_logprobs_sent: bool = False
    prompt_reasoning: bool | None = None  # RequestOutput.prompt_reasoning


class RequestValidator:
    """Tokenizes and checks the requests of clients against the engine's limits (the context length, the KV
    cache, the vocabulary, max_num_seqs), so that a request the engine could never run is refused before
    anything is queued. It hands out the seq ids: a request of n samples takes n consecutive ones."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        eos = set(config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = sorted(eos)
        self.num_kv_blocks = 0  # the KV cache's size, set once the scheduler has told it (EngineReady)
        self.block_size = config.block_size
        assert config.max_model_len is not None
        self.max_prompt_chars = config.max_model_len * longest_token_chars(tokenizer)
        self.next_seq_id = 0  # of sample 0 of the next accepted request
        self.reasoning: ReasoningParser | None = None
        self.reasoning_token_ids = (-1, -1)  # the reasoning parser's start and end tags, one token each
        if config.reasoning_parser is not None:
            self.reasoning = get_reasoning_parser(config.reasoning_parser)
            self.reasoning_token_ids = (self._tag_token_id(self.reasoning.start),
                                        self._tag_token_id(self.reasoning.end))

    def _tag_token_id(self, tag: str) -> int:
        """The one token `tag` is; raises `ExplainedError` when the tokenizer splits it (the workers could not see
        where the reasoning ends)."""
        ids = self.tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) != 1 or not 0 <= ids[0] < self.config.vocab_size:
            raise ExplainedError(f"reasoning_parser {self.config.reasoning_parser!r} (--reasoning-parser) needs "
                                 f"{tag} to be one token of the tokenizer, but it encodes as {ids}: this model does "
                                 "not write reasoning in that form")
        return int(ids[0])

    def validate(self, client: bytes, req: GenerateRequest) -> tuple[EngineRequest, RequestState]:
        """Tokenize and check one request against the engine's limits. Raises `ValueError`."""
        params = SamplingParams.from_dict(req.sampling)
        vocab = self.config.vocab_size
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be in [1, max_num_seqs={self.config.max_num_seqs}] (the samples run at "
                             f"once), got {params.n}")
        bad_bias = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if bad_bias:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {bad_bias[0]}")
        ids = encode_prompt(self.tokenizer, req, self.max_prompt_chars)  # ints: the protocol checked given ids
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except OverflowError:  # an id past 2**63 (a numpy uint64, say): out of the vocabulary all the same
            raise PromptRejected(token_id_range_error(min(ids), max(ids), self.config.vocab_size)
                                 or f"prompt token ids must be in [0, 2**63); got min {min(ids)}, max {max(ids)}",
                                 len(ids)) from None
        assert self.config.max_model_len is not None
        error = prompt_limit_error(arr, self.config.max_model_len, self.block_size, self.num_kv_blocks, vocab)
        if error is not None:
            raise PromptRejected(error, len(ids))
        if req.max_tokens_within_context and len(ids) + params.max_tokens > self.config.max_model_len:
            raise PromptRejected(context_length_error(len(ids), params.max_tokens, self.config.max_model_len,
                                                      "messages" if req.messages is not None else "prompt"), len(ids))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seq_id = self.next_seq_id
        self.next_seq_id += params.n
        now = time.time()
        temperature = 0.0 if params.greedy else float(params.temperature)
        grammar = params.structured_outputs.grammar_spec() if params.structured_outputs is not None else None
        prompt_reasoning = None
        if self.reasoning is not None and req.messages is not None:
            prompt_reasoning = self.reasoning.prompt_reasoning(self.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
        engine_req = EngineRequest(seq_id, i32(arr), temperature, params.max_tokens, params.seed, sorted(stop_ids),
                                   now, self._options(params, stop_ids, req.messages is not None, prompt_reasoning),
                                   params.n, grammar)
        samples = [SampleState(i, self.tokenizer, ids, params, req.stream) for i in range(params.n)]
        state = RequestState(client, req.request_id, seq_id, params, len(ids), samples, now, ids, stream=req.stream,
                             num_unfinished=params.n,
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                             prompt_reasoning=prompt_reasoning)
        return engine_req, state

    def _options(self, params: SamplingParams, stop_ids: set[int], chat: bool = False,
                 prompt_reasoning: bool | None = None) -> SamplingOptions | None:
        """What the workers must apply, or None for a request that uses only temperature. Greedy requests
        drop top_k, top_p and min_p (an argmax stays the argmax); ids past the vocabulary cannot be
        sampled, so they are not masked.

        A chat request's grammar waits for the end of the reasoning when the engine has a reasoning parser (vLLM's
        default), unless its prompt closed the reasoning already (`prompt_reasoning` False); when the prompt did
        not open it either (None), a parser whose outputs open it themselves (qwen3) lets the first token be the
        start tag, else the grammar holds from that first token."""
        reasoning_start = reasoning_end = -1
        gated = chat and params.structured_outputs is not None and prompt_reasoning is not False
        if self.reasoning is not None and gated:
            start_id, reasoning_end = self.reasoning_token_ids
            if prompt_reasoning is None and not self.reasoning.starts_inside:
                reasoning_start = start_id
        vocab = self.config.vocab_size
        greedy = params.greedy
        options = SamplingOptions(
            top_k=0 if greedy or params.top_k <= 0 or params.top_k >= vocab else params.top_k,
            top_p=1.0 if greedy else float(params.top_p),
            min_p=0.0 if greedy else float(params.min_p),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty),
            logit_bias=dict(params.logit_bias or {}),
            bad_words=[w for w in bad_words_token_ids(self.tokenizer, params.bad_words or []) if max(w) < vocab],
            min_tokens=params.min_tokens,
            stop_token_ids=sorted(t for t in stop_ids if t < vocab) if params.min_tokens else [],
            logprobs=-1 if params.logprobs is None else params.logprobs,
            prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
            reasoning_end_token_id=reasoning_end,
            reasoning_start_token_id=reasoning_start,
        )
        return None if options == SamplingOptions() else options

    def tokenize(self, msg: Tokenize) -> TokenizeResult:
        """The token ids `msg.request` would run with, or why it cannot be tokenized or run (too long, ...)."""
        try:
            ids = encode_prompt(self.tokenizer, msg.request, self.max_prompt_chars)
            arr = np.asarray(ids, dtype=np.int64)
        except (ValueError, OverflowError) as exc:
            return TokenizeResult(msg.reply_id, error=str(exc) if isinstance(exc, ValueError)
                                  else "a token id does not fit in 64 bits: out of the vocabulary")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.config.vocab_size):
            return TokenizeResult(msg.reply_id, error=f"token ids must be in [0, {self.config.vocab_size}); got min "
                                                      f"{int(arr.min())}, max {int(arr.max())}")
        return TokenizeResult(msg.reply_id, ids)
