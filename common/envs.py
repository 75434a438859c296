"""Every environment variable deltaserve reads, in one place.

Each reader refuses a bad value with a `ValueError` naming the variable, the value and what is
accepted; an unset or blank variable means its default; `check_all()` reads them all, so the launcher
refuses a bad setting before it starts any process.
"""

from __future__ import annotations

import math
import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def _raw(name: str, default: str) -> str:
    """The text of variable `name`; `default` when it is unset or blank (`NAME= command` means the default, as
    for the boolean variables)."""
    raw = os.environ.get(name, "")
    return raw if raw.strip() else default


def _text(name: str) -> str | None:
    """The text of variable `name`; None when it is unset or blank (only spaces included)."""
    return _raw(name, "") or None


def _number(name: str, default: str, minimum: float, allow_minimum: bool, meaning: str,
            maximum: float = math.inf) -> float:
    """The finite float in variable `name` (`default` when unset or blank), refused unless > `minimum` (or == with
    `allow_minimum`) and <= `maximum`. NaN, infinities and non-numbers are refused (NaN compares false with every
    bound)."""
    raw = _raw(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= minimum if allow_minimum else value > minimum) or not value <= maximum \
            or not math.isfinite(value):
        bound = f"{'>=' if allow_minimum else '>'} {minimum:g}"
        bound += f" and <= {maximum:.15g}" if maximum < math.inf else ""
        raise ValueError(f"{name} must be a finite number {bound} ({meaning}), got {raw!r}")
    return value


def _whole_number(name: str, default: str, meaning: str) -> int:
    """The integer >= 0 in variable `name` (`default` when unset or blank), written in decimal digits."""
    raw = _raw(name, default)
    if not (raw.strip().isascii() and raw.strip().isdigit()) or len(raw.strip()) > 18:  # int() stops at 4300 digits
        raise ValueError(f"{name} must be a whole number >= 0 ({meaning}), got {raw[:40]!r}")
    return int(raw)


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The value of variable `name` (`default` when unset or blank), refused unless one of `choices`."""
    value = _raw(name, default).strip()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def _flag(name: str, default: bool = False) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off (any case; unset or empty is `default`)."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if not word:
        return default
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(TRUE_WORDS)} or {'/'.join(w for w in FALSE_WORDS if w)} "
                     f"(any case), got {raw!r}")


# Variables holding a folder path. The launcher starts its processes in the repository's folder, so it hands them
# these as absolute paths, resolved against its own working directory (`absolute_paths`).
PATH_VARIABLES = ("DELTASERVE_CACHE", "DELTASERVE_STEP_LOG_DIR")


def _absolute(path: str) -> str:
    """`path` against this process's working directory, `~` expanded (the shell leaves it inside quotes)."""
    return os.path.abspath(os.path.expanduser(path))


def absolute_paths(env: dict[str, str]) -> dict[str, str]:
    """`env` with each non-blank `PATH_VARIABLES` entry made absolute (`_absolute`)."""
    return {**env, **{name: _absolute(env[name]) for name in PATH_VARIABLES if env.get(name, "").strip()}}


def _folder(name: str) -> str | None:
    """The folder path in variable `name`, absolute (`_absolute`); None when unset or blank."""
    path = _text(name)
    return _absolute(path) if path else None


def usable_folder(path: str, what: str) -> str:
    """`path`, created if missing; raises `ValueError` naming `what` (a variable or an option) if it
    cannot be created or is not a folder this process may write to."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        why = "it is a file" if os.path.isfile(path) else exc.strerror or str(exc)
        raise ValueError(f"{what}={path!r} cannot be used as a folder: {why}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what}={path!r} cannot be used as a folder: it is not writable")
    return path


def cache_dir() -> str:
    """DELTASERVE_CACHE: where the demo model and downloaded test assets are kept (~/.cache/deltaserve).
    Created if missing; `ValueError` if it cannot be."""
    path = _folder("DELTASERVE_CACHE")
    return usable_folder(path, "DELTASERVE_CACHE") if path else os.path.join(os.path.expanduser("~"), ".cache",
                                                                             "deltaserve")


def check_invariants() -> bool:
    """DELTASERVE_CHECK_INVARIANTS=1 (or true/yes/on): the scheduler asserts its block-accounting
    invariants after every step (slow; for tests). A violation kills the engine with the failed
    assertion as the message."""
    return _flag("DELTASERVE_CHECK_INVARIANTS")


def step_log_dir() -> str | None:
    """DELTASERVE_STEP_LOG_DIR: every process appends one JSON line of timing per step to
    `<dir>/<process name>.jsonl` (scheduler: planning; workers: input preparation, device time,
    device idle time before the step). Created if missing; `ValueError` if it cannot be."""
    path = _folder("DELTASERVE_STEP_LOG_DIR")
    return usable_folder(path, "DELTASERVE_STEP_LOG_DIR") if path else None


def profile_with_stack() -> bool:
    """DELTASERVE_PROFILE_WITH_STACK=1 (or true/yes/on): profiling runs also record the Python call stack
    (torch.profiler's `with_stack`): every Python function call becomes an event of the traces. Off by
    default: it slows Python code several times over (5.9x on a call-heavy loop here), which changes the
    timings a profile is meant to show."""
    return _flag("DELTASERVE_PROFILE_WITH_STACK")


def client_silence_s() -> float:
    """DELTASERVE_CLIENT_SILENCE_S: seconds after which a client that sends nothing (waiting clients
    ping every 2 s) counts as gone and its requests are aborted (default 60; must be > 0)."""
    return _number("DELTASERVE_CLIENT_SILENCE_S", "60", 0.0, allow_minimum=False, meaning="seconds")


GEMV_MAX_BATCH_DEFAULT = 1  # the H200 run of benchmarks/gemv.py: ours wins at batch 1 only (benchmarks/RESULTS.md)


def gemv_max_batch() -> int:
    """DELTASERVE_GEMV_MAX_BATCH: the most rows (the tokens of a step: at decode, the batch) for which the linear
    layers and the LM head multiply with our small-batch GEMV kernel (`gpu_kernels/gemv.py`) instead of cuBLAS, where
    the fused kernels are on (CUDA without `enforce_eager`) and the weights are bf16/fp16 (default 1; 0 = always
    cuBLAS). Read when the model is built."""
    return _whole_number("DELTASERVE_GEMV_MAX_BATCH", str(GEMV_MAX_BATCH_DEFAULT), meaning="rows; 0 = off")


def decode_inline_combine() -> bool:
    """DELTASERVE_DECODE_INLINE_COMBINE: split-KV decode attention (small batches) combines its splits in its own
    launch, by the last split program of each sequence and KV head to finish, instead of in a second kernel
    (gpu_kernels/paged_decode.py). Default off until this form is timed on a GPU: an earlier one took batch 8 from 1.47
    to 1.37 ms a step on the H200, beside other changes that cost elsewhere (benchmarks/RESULTS.md, 2026-12-03
    sixth session)."""
    return _flag("DELTASERVE_DECODE_INLINE_COMBINE")


def eager_sampling() -> bool:
    """DELTASERVE_EAGER_SAMPLING: sample decode steps outside their CUDA graph, the LM head and the sampler launched
    one by one (default off: a decode step whose rows need no logits processing runs its LM head and sampler in a
    second captured graph, workers/graph_inputs.py). For measuring what the graph saves, or ruling it out."""
    return _flag("DELTASERVE_EAGER_SAMPLING")


def processed_sampler() -> str:
    """DELTASERVE_PROCESSED_SAMPLER: how a CUDA worker at TP 1 samples rows with filters, penalties, logit bias, bans,
    a grammar or logprobs. `fused` (default): one sort-free Triton sampler for the whole step
    (gpu_kernels/processed_sampling.py, workers/fused_sampling.py); `torch`: the float32 copy of those rows through
    workers/logits_processing.py, then the plain sampler (the path of every CPU worker and of TP > 1)."""
    return _choice("DELTASERVE_PROCESSED_SAMPLER", "fused", ("fused", "torch"))


def pdl() -> bool:
    """DELTASERVE_PDL: launch the decode step's Triton kernels (the GEMVs, the QK-norm/RoPE/KV-store kernel, decode
    attention) with programmatic dependent launch on GPUs of compute capability 9.0 and later
    (gpu_kernels/pdl.py): each waits in the kernel for the one before it instead of at its launch. Default on (on the
    H200 a batch-1 decode step took 1.03 ms with it, 1.17 ms without, the same tokens: benchmarks/RESULTS.md);
    0 turns it off."""
    return _flag("DELTASERVE_PDL", default=True)


# The fields of a batch-invariant matmul configuration (gpu_kernels/batch_invariant.MatmulConfig) that choose only
# the tile and the grid, with the values they may take here (block_k and k_split fix a row's arithmetic and are not
# among them): (least, most, a power of two).
MATMUL_TILE_FIELDS = {"block_m": (16, 256, True), "block_n": (16, 256, True), "group_m": (1, 64, False),
                      "num_warps": (1, 16, True), "num_stages": (1, 8, False), "programs_per_sm": (1, 16, False)}


def parse_matmul_tile(text: str, name: str = "DELTASERVE_MATMUL_SMALL_TILE") -> dict[str, int]:
    """`"block_n=32,num_warps=4"` as {"block_n": 32, "num_warps": 4}; blank gives {}.

    Raises:
        ValueError: (naming `name`) an item not `key=integer`, a key outside `MATMUL_TILE_FIELDS` or given twice,
            or a value outside its range there.
    """
    fields: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in MATMUL_TILE_FIELDS:
            raise ValueError(f"{name}: {item[:40]!r} is not key=value with a key among {', '.join(MATMUL_TILE_FIELDS)}")
        if key in fields:
            raise ValueError(f"{name}: {key} is given twice")
        least, most, power_of_two = MATMUL_TILE_FIELDS[key]
        number = int(value) if value.isascii() and value.isdigit() and len(value) <= 6 else None
        if number is None or not least <= number <= most or (power_of_two and number & (number - 1)):
            kind = "a power of two" if power_of_two else "a whole number"
            raise ValueError(f"{name}: {key} must be {kind} from {least} to {most}, got {value[:40]!r}")
        fields[key] = number
    return fields


def matmul_small_tile() -> dict[str, int]:
    """DELTASERVE_MATMUL_SMALL_TILE: the tile and grid of deterministic mode's batch-invariant matmul on a GPU for
    batches of at most 16 rows, as `key=value,...` over `MATMUL_TILE_FIELDS` (gpu_kernels/batch_invariant.py's
    HOPPER_CONFIGS otherwise; the CPU path has no tile). For another GPU, with the winner of
    `benchmarks/batch_invariant_bench.py --graph-sweep`: a row's bits stay those of the default, only its speed
    changes. Read when the kernels are imported."""
    return parse_matmul_tile(_raw("DELTASERVE_MATMUL_SMALL_TILE", ""))


def all_reduce_impl() -> str:
    """DELTASERVE_ALL_REDUCE: `auto` (default: one-shot peer-memory all-reduce for small tensors on
    GPUs, NCCL otherwise) or `nccl` (NCCL for every all-reduce; for comparison)."""
    return _choice("DELTASERVE_ALL_REDUCE", "auto", ("auto", "nccl"))


# A CPU step can legitimately take minutes: an 8k-token prefill chunk of the 135M demo model took 203 s.
STEP_TIMEOUT_DEFAULT_S = 300.0
STEP_TIMEOUT_DEFAULT_CPU_S = 3600.0


def step_timeout_s(on_cpu: bool = False) -> float:
    """DELTASERVE_STEP_TIMEOUT_S: the most seconds any step may stay unfinished before the scheduler
    declares a worker stuck (a stopped process, a hung GPU, a peer lost inside a collective) and shuts
    the engine down with that message; also the bound of a step unlike any measured so far (default
    300 on GPUs, 3600 when the workers run on CPU; 0 turns the watchdog off). Steps like measured ones
    get a bound relative to those (`scheduler_proc/watchdog.py`, `step_timeout_floor_s`)."""
    default = STEP_TIMEOUT_DEFAULT_CPU_S if on_cpu else STEP_TIMEOUT_DEFAULT_S
    return _number("DELTASERVE_STEP_TIMEOUT_S", f"{default:g}", 0.0, allow_minimum=True, meaning="seconds; 0 = off")


def step_timeout_floor_s() -> float:
    """DELTASERVE_STEP_TIMEOUT_FLOOR_S: the least seconds a step like measured ones may take before the
    watchdog fires, whatever 20 times the longest such step comes to (default 60; must be > 0)."""
    return _number("DELTASERVE_STEP_TIMEOUT_FLOOR_S", "60", 0.0, allow_minimum=False, meaning="seconds")


def scheduler_timeout_s() -> float:
    """DELTASERVE_SCHEDULER_TIMEOUT_S: seconds the frontend waits for any word from the scheduler (which
    pings it every second, busy or idle) before declaring it stopped or stuck, failing every pending
    request and shutting the engine down with that message (default 30; 0 turns the check off)."""
    return _number("DELTASERVE_SCHEDULER_TIMEOUT_S", "30", 0.0, allow_minimum=True, meaning="seconds; 0 = off")


MAX_WORKER_THREADS = 1024  # more than any machine's cores; 999999 made the worker abort creating them


def worker_threads() -> int | None:
    """DELTASERVE_WORKER_THREADS: torch's intra-op threads in each worker process, CPU or GPU (a whole number >= 1);
    None when unset, and `workers.process.worker_torch_threads` chooses: OMP_NUM_THREADS when set, else on CPU the
    cores given to the process divided among the tensor-parallel ranks, on a GPU 1. The frontend, the scheduler and
    the HTTP servers always use 1 (`common.proc.set_torch_threads`)."""
    raw = _text("DELTASERVE_WORKER_THREADS")
    if raw is None:
        return None
    word = raw.strip()
    if not (word.isascii() and word.isdigit() and len(word) <= 6 and 1 <= int(word) <= MAX_WORKER_THREADS):
        raise ValueError(f"DELTASERVE_WORKER_THREADS must be a whole number from 1 to {MAX_WORKER_THREADS} (threads), "
                         f"got {raw[:40]!r}")
    return int(word)


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS (OpenMP's and torch's variable, not ours): the thread count it gives when it is a whole
    number >= 1, else None (unset, blank, or a value torch itself ignores with a warning)."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 6 and int(raw) > 0 else None


def frontend_timeout_s() -> float:
    """DELTASERVE_FRONTEND_TIMEOUT_S: seconds the scheduler waits for any word from the frontend (which
    pings it every second, busy or idle) before declaring it stopped or stuck and ending the engine
    with that message (default 30; 0 turns the check off)."""
    return _number("DELTASERVE_FRONTEND_TIMEOUT_S", "30", 0.0, allow_minimum=True, meaning="seconds; 0 = off")


def api_key() -> str | None:
    """DELTASERVE_API_KEY: the key HTTP clients must send (`Authorization: Bearer KEY`) on every /v1 route
    (unset or blank: none needed); `launch.py --api-key` sets it for the HTTP server processes."""
    return _text("DELTASERVE_API_KEY")


def http_max_body_bytes() -> int:
    """DELTASERVE_HTTP_MAX_BODY_MB: the largest HTTP request body accepted, in MiB (default 16; larger bodies
    get a 413 before they are read)."""
    mib = _number("DELTASERVE_HTTP_MAX_BODY_MB", "16", 0.0, allow_minimum=False, meaning="MiB", maximum=1 << 20)
    limit = int(mib * (1 << 20))
    if limit < 1:
        raise ValueError(f"DELTASERVE_HTTP_MAX_BODY_MB must allow at least 1 byte (1 MiB = 1048576 bytes), got {mib!r}")
    return limit


def check_all() -> None:
    """Read every variable once; raises `ValueError` naming the first bad one."""
    http_max_body_bytes()
    client_silence_s()
    scheduler_timeout_s()
    frontend_timeout_s()
    all_reduce_impl()
    gemv_max_batch()
    eager_sampling()
    processed_sampler()
    decode_inline_combine()
    pdl()
    matmul_small_tile()
    step_timeout_s()
    step_timeout_floor_s()
    check_invariants()
    step_log_dir()
    profile_with_stack()
    worker_threads()
