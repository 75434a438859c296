"""OpenAI request fields -> the engine's `SamplingParams`, in one function.

Every sampling field an OpenAI or vLLM client may send is declared in `schema.py` (pydantic checks types
and the ranges OpenAI documents); `sampling_params` maps each to vLLM's `SamplingParams` name with
OpenAI's and vLLM's meaning, and `SamplingParams` checks the rest (float32 limits, min_tokens <=
max_tokens, non-empty stop strings). Field names that differ between the two:

- `max_completion_tokens` (chat; OpenAI's newer name) wins over `max_tokens`; both mean `max_tokens`.
- `logprobs`: for completions the number of top tokens (0..20); for chat a bool, with the number in
  `top_logprobs` (0..20), which needs `logprobs: true` as in OpenAI and vLLM.
- `logit_bias`: keys are token ids written as strings (JSON object keys), as OpenAI sends them.
- `stop`: a string or a list of strings.

vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `skip_special_tokens`,
`include_stop_str_in_output`, `stop_token_ids`, `bad_words`, `prompt_logprobs`) keep their names. As in
vLLM, `prompt_logprobs` is refused with `stream: true`. `user` is accepted and used for nothing.
"""

from __future__ import annotations

import re
from typing import Any

from common.sampling_params import SamplingParams, StructuredOutputsParams
from frontend.openai.schema import ChatCompletionRequest, CompletionRequest

MAX_TOKEN_ID_DIGITS = 19  # 2**63 - 1 has 19 digits: a longer logit_bias key is no token id (and int() may refuse it)


class UnsupportedField(ValueError):
    """A request field whose value the engine cannot run: out of range, or not allowed with another field.
    `param` is its name in the request; the message starts with it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_model_len: int) -> SamplingParams:
    """The `SamplingParams` of one OpenAI request (the same for each of its prompts; `n` samples each).

    Defaults are OpenAI's: temperature 1, n 1, max_tokens 16 for completions and, for chat, as many as
    fit in `max_model_len` (the engine stops a request at `max_model_len` tokens in all, finish reason
    "length"). Raises `UnsupportedField`, naming the request's own field name, for a value the engine
    refuses or a combination OpenAI and vLLM refuse.
    """
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        if req.top_logprobs and not req.logprobs:
            raise UnsupportedField("top_logprobs", f"top_logprobs: needs logprobs=true (got top_logprobs="
                                                   f"{req.top_logprobs} without it)")
        max_tokens = req.max_completion_tokens or req.max_tokens or max_model_len
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        logprobs = req.logprobs
    if req.prompt_logprobs is not None and req.stream:
        raise UnsupportedField("prompt_logprobs", "prompt_logprobs: not available with stream=true (as in vLLM); "
                                                  "ask for them without streaming")
    given: dict[str, Any] = {  # vLLM name -> value
        "n": req.n if req.n is not None else 1,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "top_k": req.top_k if req.top_k is not None else 0,
        "min_p": req.min_p if req.min_p is not None else 0.0,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        "logit_bias": _logit_bias(req.logit_bias),
        "bad_words": list(req.bad_words) if req.bad_words else None,
        "min_tokens": req.min_tokens,
        "stop": [req.stop] if isinstance(req.stop, str) else (list(req.stop) if req.stop else None),
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": req.prompt_logprobs,
        "max_tokens": max_tokens,
        "seed": req.seed,
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "structured_outputs": structured_outputs(req),
    }
    request_names = {"logprobs": "top_logprobs" if chat else "logprobs",
                     "max_tokens": "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"}
    try:
        return SamplingParams(**given)
    except ValueError as exc:  # the message starts with the vLLM name (maybe "logit_bias[7]"): say the request's
        message = str(exc)
        name = re.match(r"[a-z_]*", message).group(0)  # type: ignore[union-attr]
        field = request_names.get(name, name)
        rest = message[len(name):].replace("max_tokens=", request_names["max_tokens"] + "=")  # min_tokens' bound
        raise UnsupportedField(field, field + rest) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias map (token id as a string -> bias) keyed by int token ids. Raises
    `UnsupportedField` for a key that is not a token id (digits, below 2**63)."""
    if not bias:
        return None
    bad = next((k for k in bias if not (k.isascii() and k.isdigit()) or len(k) > MAX_TOKEN_ID_DIGITS
                or int(k) >= 2**63), None)
    if bad is not None:
        shown = bad if len(bad) <= 40 else f"{bad[:40]}... ({len(bad)} characters)"
        raise UnsupportedField("logit_bias", f"logit_bias: keys must be token ids (decimal digits, below 2**63), "
                                             f"got {shown!r}")
    return {int(k): v for k, v in bias.items()}


# vLLM's structured-output request fields -> the StructuredOutputsParams field each sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output_field(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field that constrains its output (`response_format`, `structured_outputs`, `guided_*`), or
    None."""
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.type != "text":
        return "response_format"
    if req.structured_outputs is not None:
        return "structured_outputs"
    return next((name for name in GUIDED_FIELDS if getattr(req, name) is not None), None)


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's `SamplingParams.structured_outputs` (as a dict), from OpenAI's `response_format`
    (`json_object`: any JSON object; `json_schema`: its `schema`) or vLLM's `structured_outputs` and
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; None if it sets none. Raises
    `UnsupportedField` naming the field for more than one of them, or a value StructuredOutputsParams refuses
    (a schema the grammar library cannot compile fails the request later, from the engine)."""
    given: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise UnsupportedField("response_format", "response_format: type 'json_schema' needs "
                                                      "json_schema.schema (a JSON schema)")
        given.append(("response_format", {"json": spec.json_schema}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in GUIDED_FIELDS.items():
        if getattr(req, name) is not None:
            given.append((name, {key: getattr(req, name)}))
    if not given:
        return None
    if len(given) > 1:
        names = [name for name, _ in given]
        raise UnsupportedField(names[1], f"{names[1]}: only one structured-output field may be set, got "
                                         f"{' and '.join(names)}")
    name, value = given[0]
    try:
        StructuredOutputsParams.from_value(dict(value))
    except (TypeError, ValueError) as exc:  # its message names structured_outputs' field: prefix only an alias
        message = str(exc)
        raise UnsupportedField(name, message if message.startswith(name) else f"{name}: {message}") from None
    return value
