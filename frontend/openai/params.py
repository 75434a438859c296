"""OpenAI request fields -> the engine's `SamplingParams`, in one function.

Every sampling field an OpenAI or vLLM client may send is declared in `schema.py`; `sampling_params` maps
each to vLLM's `SamplingParams` name. The fields the engine does not run yet are listed in
`NOT_SUPPORTED_YET`: a request that gives one of them anything but its neutral value (n=1, top_p=1,
penalties 0, ...) is refused with a 400 naming the field, instead of being run as if it had not been sent.
Switching one on is deleting its line there once `SamplingParams` has the field (for `n` and `logprobs`
the response builders in `routes.py` must learn per-sample outputs as well).
"""

from __future__ import annotations

import json
from typing import Any

from common.sampling_params import SamplingParams, StructuredOutputsParams
from frontend.openai.schema import ChatCompletionRequest, CompletionRequest

# vLLM's SamplingParams names -> the value that means "off"; these fields are refused unless off.
NOT_SUPPORTED_YET: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "logit_bias": ({},),
    "bad_words": ([],),
    "min_tokens": (0,),
    "stop": ([],),
    "include_stop_str_in_output": (False,),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
}


class UnsupportedField(ValueError):
    """A request field the engine cannot honour (yet); `param` is its name in the request."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_model_len: int) -> SamplingParams:
    """The `SamplingParams` of one OpenAI request (per prompt; `n` samples of each once supported).

    Defaults are OpenAI's: temperature 1, max_tokens 16 for completions and, for chat, as many as fit in
    `max_model_len` (the engine stops a request at `max_model_len` tokens in all, finish reason "length").
    Raises `UnsupportedField` for a field set to a value the engine does not run (naming the request's own
    field name), and `ValueError` (starting with the field's name) for a value `SamplingParams` refuses.
    """
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        max_tokens = req.max_completion_tokens or req.max_tokens or max_model_len
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_field = "logprobs" if req.top_logprobs is None else "top_logprobs"
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        logprobs, logprobs_field = req.logprobs, "logprobs"
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
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
        "bad_words": list(req.bad_words or []),
        "min_tokens": req.min_tokens,
        "stop": stop,
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
    request_names = {"logprobs": logprobs_field, "max_tokens": "max_completion_tokens" if chat and
                     req.max_completion_tokens else "max_tokens"}
    for name, off in NOT_SUPPORTED_YET.items():
        value = given.pop(name)
        if value not in off:
            field = request_names.get(name, name)
            raise UnsupportedField(field, f"{field}: not supported yet by this engine (got {json.dumps(value)}; "
                                          f"only {json.dumps(off[0])} is accepted for now)")
    try:
        return SamplingParams(**given)
    except ValueError as exc:  # the message starts with the vLLM name: say the request's own
        name, _, rest = str(exc).partition(" ")
        raise UnsupportedField(request_names.get(name, name), f"{request_names.get(name, name)} {rest}") from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias map (token id as a string -> bias) keyed by int token ids. Raises
    `UnsupportedField` for a key that is not a token id."""
    bad = next((k for k in bias or {} if not (k.isascii() and k.isdigit()) or int(k) >= 2**63), None)
    if bad is not None:
        raise UnsupportedField("logit_bias", f"logit_bias: keys must be token ids (digits), got {bad!r}")
    return {int(k): v for k, v in (bias or {}).items()}


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
    except (TypeError, ValueError) as exc:
        raise UnsupportedField(name, f"{name}: {exc}") from None
    return value
