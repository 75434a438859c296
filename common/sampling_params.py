"""Per-request sampling parameters (vLLM's names, meanings and defaults; nano-vllm's `max_tokens` default)."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from common.errors import quote
from common.protocol import GrammarSpec, python_numbers

TOKEN_ID_LIMIT = 2**63  # token ids and counts travel as 64-bit integers
# A request's seed is in [0, SEED_LIMIT): the sampler keys its noise by the seed modulo 2**63
# (workers/sampler.py), so a negative or larger seed would repeat one of these. The engine's seed
# (EngineConfig.seed) takes the same range.
SEED_LIMIT = 2**63
# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): 1 / T would reach float32 ranges where
# logits / T overflows, and the distribution is an argmax for any practical purpose anyway.
GREEDY_TEMPERATURE = 1e-5
FLOAT32_MAX = 3.4028234663852886e38  # the workers compute in float32
MAX_LOGPROBS = 20  # most top entries `logprobs` and `prompt_logprobs` may ask for (vLLM's default max_logprobs)
MAX_BAD_WORDS = 1024  # bad words a request may give: each costs the workers a prefix match every step
MAX_STOP_STRINGS = 256  # stop strings a request may give: each is searched for after every token
# Characters of one bad word and of one stop string: the frontend tokenizes every bad word in its one loop (1,024
# words of 40,000 characters held it past the scheduler's 30 s liveness limit, which ended the engine), and each
# stop string is searched for in the text after every token.
MAX_BAD_WORD_CHARS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_SCHEMA_DEPTH = 64  # objects and arrays inside one another in a JSON schema (a deeper one overflowed Python's stack)
MAX_LOGIT_BIAS = 100.0  # |bias| limit, as in OpenAI's API: -100 bans a token, +100 all but forces it
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, sample index) over 63 bits


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of

    - `json`: a JSON schema, as a dict or as its JSON text; the output is a JSON document valid against it
      (properties in the schema's order, no property the schema does not name);
    - `regex`: the whole output matches this regular expression;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: an EBNF grammar (GBNF, llama.cpp's and xgrammar's dialect) with a `root` rule;
    - `json_object`: True: the output is some JSON object;

    and, for `json` and `json_object`, `disable_any_whitespace`: True allows no whitespace between JSON
    elements (vLLM's option; by default any whitespace is allowed, which small models may repeat until
    `max_tokens`).

    The workers compile it with xgrammar (workers/structured_output.py). `validate` checks the shape here;
    a schema, regex or grammar that the library cannot compile fails its request with the library's reason.
    Raises `ValueError` naming the field (`structured_outputs.json`, ...).
    """

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the bad field; normalizes in place (a schema given as JSON text becomes
        the value it encodes, `choice` a list)."""
        given = [f.name for f in fields(self) if f.name in CONSTRAINTS and getattr(self, f.name) is not None
                 and (f.name == "json" or getattr(self, f.name) is not False)]  # json=False is a (refused) schema
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(CONSTRAINTS)}; got "
                             f"{'none' if not given else ' and '.join(given)}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON text: {exc}") from None
        if self.json is False:
            raise ValueError("structured_outputs.json: the schema false accepts no document at all")
        if self.json is True:  # the schema true is the empty schema: any JSON document
            self.json = {}
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object, or true), got "
                             f"{quote(self.json)}")
        if isinstance(self.json, dict):
            if _nesting_depth(self.json) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs.json: the schema nests objects and arrays more than "
                                 f"{MAX_SCHEMA_DEPTH} levels deep")
            try:
                json.dumps(self.json, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as exc:  # bytes, NaN, a map key that is a list, ...
                raise ValueError(f"structured_outputs.json is not a JSON document ({exc}): "
                                 f"{quote(self.json)}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {quote(value)}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{quote(self.choice)}")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {quote(value)}")

    @property
    def kind(self) -> str:
        """The constraint set: one of `CONSTRAINTS`."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def grammar_spec(self) -> GrammarSpec:
        """The constraint as the workers compile it (a JSON schema as compact JSON text, in its key order)."""
        kind = self.kind
        if kind == "json":
            spec = json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        elif kind == "choice":
            spec = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return GrammarSpec(kind, spec, any_whitespace=not self.disable_any_whitespace)

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams | None:
        """From a `StructuredOutputsParams`, its dict (the wire form; unknown keys raise `ValueError` naming
        them), or None."""
        if value is None:
            return None
        if isinstance(value, cls):
            value.validate()
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a map such as {{'json': schema}}, or None, got "
                             f"{quote(value)}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(map(str, set(value) - set(known)))
        if unknown:
            raise ValueError(f"unknown structured_outputs fields {quote(unknown)}; known: {known}")
        return cls(**value)


def _nesting_depth(value: Any) -> int:
    """How many dicts and lists lie inside one another in `value` (1 for a flat dict; MAX_SCHEMA_DEPTH + 1 for
    anything deeper), counted without recursion, so a document of any depth gets an answer, not a RecursionError."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_SCHEMA_DEPTH:  # past the limit the answer is known to be too deep
            stack.extend((child, depth + 1) for child in children)
    return deepest


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")  # StructuredOutputsParams: exactly one of these


@dataclass
class SamplingParams:
    """How to sample one request's output. Names, meanings and defaults are vLLM's; a bad value raises
    `ValueError` naming the field and its allowed range (`validate`).

    Numpy numbers are accepted wherever Python ones are (and numpy arrays as lists); they are stored as
    Python numbers, which is what travels to the engine.

    Sampling (the workers apply these to each row's logits, in this order; see workers/logits_processing.py):
    - `logit_bias`: {token id: bias in [-100, 100]} added to those logits first.
    - `bad_words`: words never to generate (at most MAX_BAD_WORDS, of MAX_BAD_WORD_CHARS each): each is
      tokenized (alone and after a space) and its last token is banned whenever the output ends with the word's
      other tokens.
    - `min_tokens`: end tokens and `stop_token_ids` cannot be sampled (and stop strings do not fire) until
      this many tokens were generated (0..max_tokens).
    - `repetition_penalty` (> 0; 1 = off): logits of tokens in the prompt or the output are divided by it
      when positive and multiplied by it when negative (as in vLLM and transformers). Its value and its
      reciprocal must be finite in float32.
    - `frequency_penalty`, `presence_penalty` in [-2, 2] (0 = off): OpenAI's, over output tokens: the
      logit of a token already generated c times drops by frequency_penalty * c + presence_penalty.
    - `temperature` in [0, 3.4e38] (float32): 0 (and anything below 1e-5) samples greedily, the argmax;
      otherwise softmax(logits / temperature) is sampled (Gumbel-max). Greedy requests ignore top_k,
      top_p and min_p (they cannot change an argmax).
    - `top_k` (0 or -1 = off, else >= 1): keep the k most likely tokens (ties with the k-th are kept).
    - `top_p` in (0, 1] (1 = off): keep the most likely tokens while the probability of those more likely
      than a token is below top_p.
    - `min_p` in [0, 1] (0 = off): drop tokens less likely than min_p times the most likely one.
    - `seed`: an integer in [0, 2**63) that makes this request's samples reproducible whatever else is in
      the batch (None: the engine's own seeded stream). Sample i of n uses `sample_seed(seed, i)`.
    - `n` (>= 1): independent samples of the prompt; the engine computes the prompt once.

    Stopping:
    - `max_tokens`: the most output tokens to generate (>= 1). Generation also stops at `max_model_len`
      total tokens, with finish reason "length".
    - `stop`: a string or list of non-empty strings; generation stops when the output text contains one
      (finish reason "stop", `stop_reason` the string). The text ends before it unless
      `include_stop_str_in_output`, and the token ids end with the token that completed it.
    - `stop_token_ids`: token ids that end generation (finish reason "stop", `stop_reason` the id); they
      apply even with `ignore_eos`. The model's end tokens (the tokenizer's EOS and every eos_token_id of
      generation_config.json) end it too unless `ignore_eos`. A stop token stays in the token ids; its
      text is left out of the text unless `include_stop_str_in_output`.
    - `skip_special_tokens`: leave special tokens out of the returned text (token ids keep them).

    Logprobs:
    - `logprobs` (None or 0..20): each sampled token's logprob and rank, and the N most likely tokens, from
      the distribution the token was drawn from: log_softmax of the logits after every step above
      (temperature 1 for greedy requests), so tokens that top_k/top_p/min_p removed are not listed.
    - `prompt_logprobs` (None or 0..20): the same for every prompt token but the first, from the model's
      raw logits (no parameter applied). Such requests skip the prefix cache (every position is computed).

    Structured outputs:
    - `structured_outputs`: a `StructuredOutputsParams` (or its dict, e.g. {"json": schema}, {"regex": r"..."},
      {"choice": [...]}, {"grammar": ebnf}, {"json_object": True}): only tokens that keep the output inside
      that language are sampled (the token mask is applied first, before logit bias and every filter). The
      output then ends with the model's end token when the language allows it; `max_tokens` still bounds it
      (finish reason "length": the output so far, possibly incomplete).
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise `ValueError` naming the bad field and the allowed range. Normalizes in place: numpy
        numbers become Python ones, `stop` becomes a list, `logit_bias` keys given as digit strings
        (JSON objects) become integers."""
        for name in self.__dataclass_fields__:
            setattr(self, name, python_numbers(getattr(self, name)))
        _number("temperature", self.temperature, 0.0, FLOAT32_MAX, "[0, 3.4e38] (float32; below 1e-5 = greedy)")
        _integer("max_tokens", self.max_tokens, 1, TOKEN_ID_LIMIT - 1, "[1, 2**63)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {quote(getattr(self, name))}")
        if self.seed is not None:
            _integer("seed", self.seed, 0, SEED_LIMIT - 1, "[0, 2**63) or None")
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        _integer("n", self.n, 1, 2**31 - 1, "[1, 2**31)")
        _number("top_p", self.top_p, 0.0, 1.0, "(0, 1] (1 = off)", low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k < TOKEN_ID_LIMIT:
            raise ValueError(f"top_k must be an integer >= 1, or 0 or -1 for off, got {quote(self.top_k)}")
        _number("min_p", self.min_p, 0.0, 1.0, "[0, 1] (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), -2.0, 2.0, "[-2, 2] (0 = off)")
        rp = self.repetition_penalty
        if (isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0
                or rp > FLOAT32_MAX or 1 / rp > FLOAT32_MAX):
            raise ValueError("repetition_penalty must be a number > 0 whose value and reciprocal are finite in "
                             f"float32 (about 2.9e-39 to 3.4e38; 1 = off), got {quote(rp)}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                                       for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings or None, got {quote(self.bad_words)}")
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            longest = max((len(w) for w in self.bad_words), default=0)
            if longest > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words: each word may have at most {MAX_BAD_WORD_CHARS} characters, got one "
                                 f"of {longest}")
            self.bad_words = list(self.bad_words)
        _integer("min_tokens", self.min_tokens, 0, TOKEN_ID_LIMIT - 1, "[0, max_tokens]")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        given_stop = self.stop
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, or None, got {quote(given_stop)}")
            if not all(self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them: an empty string would match "
                                 f"before any output text (vLLM refuses it too), got {quote(given_stop)}")
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
            longest = max(len(x) for x in self.stop) if self.stop else 0
            if longest > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: each string may have at most {MAX_STOP_STRING_CHARS} characters, got one "
                                 f"of {longest}")
            self.stop = list(self.stop)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, MAX_LOGPROBS, f"[0, {MAX_LOGPROBS}] or None")
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict; unknown keys raise `ValueError` (a typo must not be ignored)."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling parameters must be a map, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise ValueError(f"unknown sampling parameters {quote(unknown)}; known: {sorted(known)}")
        return cls(**data)


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0 (so n = 1
    samples what it always did), else a 63-bit mix of (seed, index); None stays None."""
    if seed is None or index == 0:
        return seed
    return ((seed ^ (index * _SEED_MIX)) * _SEED_MIX + index) & 0x7FFF_FFFF_FFFF_FFFF


def _number(name: str, value: Any, low: float, high: float, allowed: str, low_open: bool = False) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < low or (low_open and value == low) or value > high):
        raise ValueError(f"{name} must be a finite number in {allowed}, got {quote(value)}")


def _integer(name: str, value: Any, low: int, high: int, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {allowed}, got {quote(value)}")


def _token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < TOKEN_ID_LIMIT for i in value
    ):
        raise ValueError(f"{name} must be a list of integers in [0, 2**63), got {quote(value)}")
    return list(value)


def _logit_bias(value: Any) -> dict[int, float] | None:
    """The bias map with integer keys, or raise naming the bad entry."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, or None, got {quote(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        key, bias = python_numbers(key), python_numbers(bias)
        if isinstance(key, str) and key.strip().isdigit():  # JSON object keys are strings
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or not 0 <= key < TOKEN_ID_LIMIT:
            raise ValueError(f"logit_bias keys must be token ids (integers in [0, 2**63)), got {quote(key)}")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)
                or abs(bias) > MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias[{key}] must be a finite number in [-100, 100], got {quote(bias)}")
        out[int(key)] = float(bias)
    return out
