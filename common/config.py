"""Engine configuration: one frozen dataclass shared by every process.

The launcher builds an `EngineConfig` from vLLM-style keyword arguments (or CLI flags of the same
names), validates it in `__post_init__`, and hands it to every process as JSON (`to_json` /
`from_json`): the config never crosses a socket as pickle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from common.protocol import MIN_MAX_MESSAGE_BYTES, python_numbers
from common.sampling_params import SEED_LIMIT

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "flash-attn", "triton", "torch")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")  # auto: llguidance for JSON, xgrammar for the rest
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8 = fp8_e4m3 (float8 e4m3fn)
DEVICES = ("auto", "cpu", "cuda")
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; the parsers are frontend/reasoning_parsers.py's
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Steps a profiling run traces by itself when `profile_steps` is not given: bounded, since a trace grows with
# every step it holds (a worker's torch trace keeps each op and kernel of the window in memory until it stops).
DEFAULT_PROFILE_STEPS = "0:100"
MAX_PROFILE_STEPS = 2**31 - 1  # most steps one profiling session may trace (a client's, the HTTP route's, a window's)
MAX_STEP_ID = 2**62  # step ids travel as msgpack integers: a window ends well inside int64
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # 64 MiB: e.g. a submission of 800 prompts of 16k token ids
MAX_STEPS_IN_FLIGHT = 4  # steps the scheduler may plan ahead of the results; each needs a worker's host buffers


class ConfigError(ValueError):
    """An engine setting is invalid; the message names the setting and the limit."""


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, with vLLM's names and meanings.

    Lengths are in tokens, memory in GiB, `block_size` in tokens per KV-cache block.
    Raises `ConfigError` for a missing model folder, an unsupported architecture, or any
    out-of-range value.
    """

    model: str
    tokenizer: str | None = None
    served_model_name: tuple[str, ...] | None = None  # names clients use for it; None: the model folder's name
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kvcache_blocks: int | None = None  # force the KV cache size (tests, debugging)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None  # fixed KV-cache size; CPU default 1 GiB
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, then every 16, and max_num_seqs
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0  # in [0, 2**63), the range of a request's seed
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"
    structured_outputs_backend: str = "auto"  # see workers/structured_output.py
    kv_cache_dtype: str = "auto"  # "fp8": e4m3 with a per-layer scale for K and for V (workers/kv_cache.py)
    enable_prefix_caching: bool = True
    profile_dir: str | None = None  # profiling runs (common/profiling.py): every process writes its traces here
    profile_steps: str = DEFAULT_PROFILE_STEPS  # "A:B": trace steps A..B-1 by itself; "none": only on request
    log_level: str = "WARNING"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # client messages larger than this are refused unread
    max_waiting_requests: int | None = None  # None: unlimited; beyond it a request is refused ("overloaded")
    # Steps planned ahead of the workers' results (scheduler_proc/scheduler.py): 2 plans step N+1 while N runs;
    # 3 leaves the plan of N+2 two device steps to arrive in, for steps shorter than the host's round trip.
    max_steps_in_flight: int = 2
    # Chat outputs split into reasoning and answer (frontend/reasoning_parsers.py); a grammar starts after it
    reasoning_parser: str | None = None
    # Every request's logits bitwise the same whatever else is in its batch (workers/deterministic.py)
    deterministic: bool = False
    # Filled by `resolve()` from the checkpoint's config.json; not user settings.
    architecture: str = ""
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        def positive(name: str, value: object, allow_none: bool = False, integer: bool = True) -> None:
            if value is None and allow_none:
                return
            kinds = (int,) if integer else (int, float)
            if not isinstance(value, kinds) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")

        for f in dataclasses.fields(self):  # numpy numbers are taken as the Python ones (what JSON carries)
            object.__setattr__(self, f.name, python_numbers(getattr(self, f.name)))
        if not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"model must be a folder path, got {self.model!r}")
        object.__setattr__(self, "model", os.fspath(self.model))
        if os.path.isfile(self.model):
            raise ConfigError(f"model {self.model!r} is a file: give the checkpoint's folder")
        if not os.path.isdir(self.model):
            raise ConfigError(f"model folder {self.model!r} does not exist (models load from local folders)")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ConfigError(f"model folder {self.model!r} has no config.json: not a Hugging Face checkpoint")
        # The processes start in the repository's folder, not the caller's: a relative path must not travel.
        object.__setattr__(self, "model", os.path.abspath(self.model))
        positive("max_model_len", self.max_model_len, allow_none=True)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("block_size", self.block_size)
        positive("num_kvcache_blocks", self.num_kvcache_blocks, allow_none=True)
        positive("kv_cache_memory_gb", self.kv_cache_memory_gb, allow_none=True, integer=False)
        positive("tensor_parallel_size", self.tensor_parallel_size)
        positive("max_waiting_requests", self.max_waiting_requests, allow_none=True)
        k = self.max_steps_in_flight
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_STEPS_IN_FLIGHT:
            raise ConfigError(f"max_steps_in_flight must be an integer in [1, {MAX_STEPS_IN_FLIGHT}], got {k!r}")
        m = self.max_message_bytes
        if isinstance(m, bool) or not isinstance(m, int) or m < MIN_MAX_MESSAGE_BYTES:
            raise ConfigError(f"max_message_bytes must be an integer >= {MIN_MAX_MESSAGE_BYTES} (64 KiB), got {m!r}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)):
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.log_level, str) or self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        names = self.served_model_name
        if isinstance(names, str):
            names = (names,)
        if names is not None and (not isinstance(names, (list, tuple)) or not names
                                  or not all(isinstance(n, str) and n.strip() for n in names)):
            raise ConfigError(f"served_model_name must be a non-empty name or list of names, got {names!r}")
        object.__setattr__(self, "served_model_name", None if names is None else tuple(names))
        if self.tokenizer is not None:
            if not os.path.isdir(self.tokenizer):
                raise ConfigError(f"tokenizer folder {self.tokenizer!r} does not exist")
            object.__setattr__(self, "tokenizer", os.path.abspath(os.fspath(self.tokenizer)))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ConfigError(f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
                              f"got {self.structured_outputs_backend!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"deterministic must be true or false, got {self.deterministic!r}")
        if self.deterministic and self.attention_backend == "flash-attn":
            raise ConfigError("deterministic needs the torch (CPU) or triton (GPU) attention backend: FlashAttention's "
                              "varlen kernels are not batch-invariant")
        if self.deterministic and self.tensor_parallel_size > 2:
            # two ranks' partial sums add in one (commutative) operation; three or more in an order that follows
            # how the all-reduce splits the batch's tensor
            raise ConfigError(f"deterministic needs tensor_parallel_size (--tensor-parallel-size) 1 or 2, got "
                              f"{self.tensor_parallel_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flash-attn":
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} needs the triton or torch attention backend: "
                              "the flash-attn backend does not read an fp8 KV cache")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if (not isinstance(sizes, (list, tuple)) or not sizes
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)):
                raise ConfigError(f"cuda_graph_sizes must be a non-empty list of positive integers, got {sizes!r}")
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.profile_dir is not None:  # as for the model: the processes run in the repository's folder
            if not os.fspath(self.profile_dir).strip():
                raise ConfigError(f"profile_dir must name a folder, got {self.profile_dir!r}")
            object.__setattr__(self, "profile_dir", os.path.abspath(os.fspath(self.profile_dir)))
        if isinstance(self.profile_steps, (list, tuple)) and len(self.profile_steps) == 2:
            object.__setattr__(self, "profile_steps", ":".join(str(s) for s in self.profile_steps))
        parse_profile_steps(self.profile_steps)
        if self.profile_steps != DEFAULT_PROFILE_STEPS and not self.profile_dir:
            raise ConfigError("profile_steps needs a profile_dir (--profile-dir), the folder the traces are written to")

    # ------------------------------------------------------------------ derived values
    def resolve(self) -> EngineConfig:
        """Read the checkpoint's config.json and fill the derived fields.

        Raises `ConfigError` for an unsupported architecture, a `max_model_len` beyond the model's
        positions, or a tensor-parallel size that does not split every sharded dimension
        (`tensor_parallel_errors`), a `profile_dir` that cannot be created, or a CUDA device or GPU attention
        backend this host lacks, before any worker starts.
        """
        if self.profile_dir:
            from common.envs import usable_folder

            try:
                usable_folder(self.profile_dir, "profile_dir")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        hf = load_hf_config(self.model)
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), "")
        if not arch:
            raise ConfigError(
                f"model {self.model!r} has architectures {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_max = int(getattr(hf, "max_position_embeddings", 0) or 0) or 4096
        max_model_len = self.max_model_len or model_max
        window = getattr(hf, "sliding_window", None)
        if arch == "MistralForCausalLM" and window and window < max_model_len:
            raise ConfigError(f"sliding-window attention (window {window} < max_model_len {max_model_len}) is not "
                              f"supported: set max_model_len <= {window}")
        if max_model_len > model_max:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {model_max}")
        self._check_device()
        tp_errors = tensor_parallel_errors(hf, self.tensor_parallel_size)
        if tp_errors:
            raise ConfigError(f"{self.model}/config.json cannot be split over {self.tensor_parallel_size} "
                              f"tensor-parallel ranks: {'; '.join(tp_errors)}")
        eos = hf_eos_token_ids(self.model, hf)
        return dataclasses.replace(
            self,
            max_model_len=max_model_len,
            architecture=arch,
            vocab_size=int(hf.vocab_size),
            eos_token_ids=tuple(eos),
        )

    def _check_device(self) -> None:
        """Refuse, before any process starts, a CUDA device or a GPU attention backend this host cannot give (the
        workers would find out only after starting). Imports torch only where one is asked for."""
        if self.device != "cuda" and self.attention_backend not in ("triton", "flash-attn"):
            return
        import torch

        cuda = torch.cuda.is_available()
        if self.device == "cuda" and not cuda:
            raise ConfigError("device 'cuda' was requested but CUDA is not available on this host")
        if self.device == "cpu" or not cuda:
            if self.attention_backend == "flash-attn":
                raise ConfigError("the flash-attn attention backend needs a CUDA device; on a CPU use the torch "
                                  "backend (attention_backend auto)")
            if self.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ConfigError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for "
                                  "tests); on a CPU use the torch backend (attention_backend auto)")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names clients use for the model (the first is the one responses carry): `served_model_name`,
        or the model folder's own name (never its path, which is this machine's business)."""
        return self.served_model_name or (os.path.basename(os.path.normpath(self.model)),)

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table: blocks needed for one `max_model_len` sequence."""
        assert self.max_model_len is not None, "call resolve() first"
        return -(-self.max_model_len // self.block_size)

    # ------------------------------------------------------------------ (de)serialisation
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data: dict[str, Any] = json.loads(text)
        for key in ("cuda_graph_sizes", "eos_token_ids", "served_model_name"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)

    @classmethod
    def field_names(cls) -> list[str]:
        """User-settable field names (the derived ones are excluded)."""
        derived = {"architecture", "vocab_size", "eos_token_ids"}
        return [f.name for f in dataclasses.fields(cls) if f.name not in derived]


def parse_profile_steps(text: object) -> tuple[int, int] | None:
    """The step window of `profile_steps`: "A:B" -> (A, B), the steps A..B-1 like a Python slice;
    "none" -> None (no window of its own: sessions start only when a client asks).

    Raises `ConfigError` naming the setting unless 0 <= A < B."""
    if isinstance(text, str) and text.strip().lower() == "none":
        return None
    first, sep, end = text.partition(":") if isinstance(text, str) else ("", "", "")
    try:
        window = (int(first), int(end)) if sep else None
    except ValueError:
        window = None
    if window is None or not 0 <= window[0] < window[1]:
        raise ConfigError(f"profile_steps must be 'A:B' with 0 <= A < B (the steps A..B-1) or 'none', got {text!r}")
    if window[1] - window[0] > MAX_PROFILE_STEPS or window[1] > MAX_STEP_ID:
        raise ConfigError(f"profile_steps may trace at most {MAX_PROFILE_STEPS} steps (a trace keeps every event in "
                          f"memory), ending by step {MAX_STEP_ID}; got {text!r}")
    return window


def tensor_parallel_errors(hf_config: Any, tp: int) -> list[str]:
    """Why `tp` ranks cannot split this model as workers/layers shard it; [] if they can.

    Query heads and the MLP's intermediate size are divided evenly over the ranks (q/k/v and gate/up
    by output rows, o_proj and down_proj by input columns). KV heads are divided too, or, when fewer
    than the ranks, replicated (so `tp` must be a multiple of them). The vocabulary (embedding and
    LM head) is split in slices of ceil(vocab_size / tp) rows, padded on the last rank, so it needs
    no divisibility, only a row for every rank.
    """
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate, vocab = hf_config.intermediate_size, hf_config.vocab_size
    errors = []
    if heads % tp:
        errors.append(f"tensor_parallel_size {tp} does not divide num_attention_heads {heads}")
    if kv_heads % tp and tp % kv_heads:
        errors.append(f"tensor_parallel_size {tp} and num_key_value_heads {kv_heads}: one must divide the other")
    if intermediate % tp:
        errors.append(f"tensor_parallel_size {tp} does not divide intermediate_size {intermediate}")
    rows = -(-vocab // tp)
    if (tp - 1) * rows >= vocab:
        errors.append(f"vocab_size {vocab} is too small for {tp} ranks: slices of {rows} rows leave the last empty")
    return errors


# Sizes in config.json that must be positive integers when given (transformers does not check them).
MODEL_DIMENSIONS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings")


def _read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in file `path`; raises `ConfigError` naming the file if it cannot be read or
    holds something else."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"cannot read {path}: it holds a JSON {type(raw).__name__}, not an object")
    return raw


def load_hf_config(model_dir: str) -> Any:
    """The checkpoint's `transformers` config. Raises `ConfigError` naming config.json if it cannot be
    parsed or gives a size (`MODEL_DIMENSIONS`) that is not a positive integer."""
    from transformers import AutoConfig

    path = os.path.join(model_dir, "config.json")
    raw = _read_json_object(path)
    for name in MODEL_DIMENSIONS:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{path}: {name} must be a positive integer, got {value!r}")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises several types for a bad config.json
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def hf_eos_token_ids(model_dir: str, hf_config: Any) -> list[int]:
    """End-of-sequence ids: generation_config.json's `eos_token_id` (int or list), else config.json's.

    Raises `ConfigError` naming the file whose `eos_token_id` is not a non-negative integer or a list of them.
    """
    eos: Any = None
    source = os.path.join(model_dir, "config.json")
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json_object(gen_path)
        eos = gen.get("eos_token_id")
        if eos is not None:
            source = gen_path
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise ConfigError(f"{source}: eos_token_id must be a non-negative integer or a list of them, got {eos!r}")
    return ids
