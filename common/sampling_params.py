"""Per-request sampling parameters (nano-vllm's and vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from common.errors import quote
from common.protocol import python_numbers

TOKEN_ID_LIMIT = 2**63  # token ids and counts travel as 64-bit integers
# A request's seed is in [0, SEED_LIMIT): the sampler keys its noise by the seed modulo 2**63
# (workers/sampler.py), so a negative or larger seed would repeat one of these. The engine's seed
# (EngineConfig.seed) takes the same range.
SEED_LIMIT = 2**63


@dataclass
class SamplingParams:
    """How to sample one request's output.

    Numpy numbers are accepted wherever Python ones are (and a numpy array as `stop_token_ids`);
    they are stored as Python numbers, which is what travels to the engine.

    - `temperature`: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature)
      by the Gumbel-max trick. Negative or non-finite values raise `ValueError`.
    - `max_tokens`: the most output tokens to generate (>= 1). Generation also stops at
      `max_model_len` total tokens, with finish reason "length".
    - `ignore_eos`: keep generating past the model's end-of-sequence tokens.
    - `stop_token_ids`: extra token ids that end generation (finish reason "stop"); they apply
      even with `ignore_eos`.
    - `seed`: an integer in [0, 2**63) that makes this request's samples reproducible whatever
      else is in the batch (None: the engine's own seeded stream).
    - `skip_special_tokens`: leave special tokens out of the returned text (token ids keep them).
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the bad field and the allowed range (numpy numbers become Python ones)."""
        for name in ("temperature", "max_tokens", "seed", "ignore_eos", "skip_special_tokens", "stop_token_ids"):
            setattr(self, name, python_numbers(getattr(self, name)))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {quote(t)}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m < TOKEN_ID_LIMIT:
            raise ValueError(f"max_tokens must be an integer in [1, 2**63), got {quote(m)}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {quote(getattr(self, name))}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {quote(self.seed)}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < TOKEN_ID_LIMIT for i in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of integers in [0, 2**63), "
                             f"got {quote(self.stop_token_ids)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict; unknown keys raise `ValueError` (a typo must not be ignored)."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling parameters must be a map, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameters {quote(unknown)}; known: {sorted(known)}")
        return cls(**data)
