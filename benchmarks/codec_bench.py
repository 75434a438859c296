"""Encode and decode time of the two messages of every step, with our codec and with msgspec (CPU only).

    python benchmarks/codec_bench.py [--samples 101] [--calls 200]

Messages, as a steady decode step of 256 requests makes them:

- the `StepPlan`: 256 decode seq ids, 4 `NewBlocks` of one block each (requests crossing a block boundary),
  every other field empty (as the scheduler builds it: empty arrays given, not defaulted);
- the `StepResult`: 256 sampled token ids and rank 0's timings, no logprobs;
- the same `StepResult` with top-5 logprobs for 64 of its rows.

The msgspec version declares the same messages as `msgspec.Struct(array_like=True)` and writes the same bytes
(checked before timing): the header [PROTOCOL_VERSION, type name] spliced before the struct's own array,
int32/float32 arrays as msgpack bin, trailing fields at their defaults left off. msgspec leaves no array-like
field off (its `omit_defaults` ignores array_like structs: msgspec issue #720), so the encoder here walks the
struct in Python, as ours does, and msgspec only packs the result; the decoder is all msgspec's (typed, validated,
missing trailing fields defaulted, arrays by a `dec_hook`).

Each figure is the median over `--samples` samples of the mean of `--calls` calls, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

# The repository root must come before benchmarks/ on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    Logprobs,
    NewBlocks,
    StepPlan,
    StepResult,
    decode,
    encode,
    f32,
    i32,
)

try:
    import msgspec
except ImportError:  # the comparison needs it; the engine does not
    sys.exit("codec_bench.py compares with msgspec: pip install msgspec")

NUM_ROWS = 256
NUM_LOGPROB_ROWS = 64
TOP_N = 5
VOCAB_SIZE = 151936
BLOCK_SIZE = 16


# ============================================================================ the messages, msgspec's way
class I32(np.ndarray):
    """Field type of an int32 array (decoded by `_dec_hook` as a read-only view of the received bytes)."""


class F32(np.ndarray):
    """Field type of a float32 array."""


def _empty(kind: type) -> Any:
    return msgspec.field(default_factory=lambda: np.zeros(0, "<i4" if kind is I32 else "<f4").view(kind))


class MSamplingOptions(msgspec.Struct, array_like=True):
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    bad_words: list[list[int]] = []
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    logprobs: int = -1
    prompt_logprobs: int = -1
    grammar_id: int = -1


class MNewRequest(msgspec.Struct, array_like=True):
    seq_id: int
    prompt_token_ids: I32
    temperature: float
    seed: int | None
    block_ids: I32
    num_computed_tokens: int
    num_scheduled_tokens: int
    options: MSamplingOptions | None = None


class MForkedRequest(msgspec.Struct, array_like=True):
    seq_id: int
    parent_seq_id: int
    seed: int | None
    block_ids: I32


class MResumedRequest(msgspec.Struct, array_like=True):
    seq_id: int
    block_ids: I32
    num_computed_tokens: int
    num_scheduled_tokens: int


class MNewBlocks(msgspec.Struct, array_like=True):
    seq_id: int
    block_ids: I32


class MStepPlan(msgspec.Struct, array_like=True):
    step_id: int
    new_requests: list[MNewRequest] = []
    resumed_requests: list[MResumedRequest] = []
    prefill_seq_ids: I32 = _empty(I32)
    prefill_num_tokens: I32 = _empty(I32)
    decode_seq_ids: I32 = _empty(I32)
    new_blocks: list[MNewBlocks] = []
    finished_seq_ids: I32 = _empty(I32)
    preempted_seq_ids: I32 = _empty(I32)
    forked_requests: list[MForkedRequest] = []


class MLogprobs(msgspec.Struct, array_like=True):
    rows: I32
    counts: I32
    num_top: I32
    token_logprobs: F32
    ranks: I32
    top_token_ids: I32
    top_logprobs: F32


class MStepResult(msgspec.Struct, array_like=True):
    step_id: int
    sampled_token_ids: I32 = _empty(I32)
    timings: dict[str, Any] = {}
    logprobs: MLogprobs | None = None
    prompt_logprobs: MLogprobs | None = None
    failed: dict[int, str] = {}


class MsgspecCodec:
    """The same bytes as `common.protocol.encode` for the structs above, msgspec packing and decoding them."""

    def __init__(self, messages: list[type]) -> None:
        self.packer = msgspec.msgpack.Encoder()
        self.decoders = {cls.__name__.removeprefix("M"): msgspec.msgpack.Decoder(cls, dec_hook=self._dec_hook)
                         for cls in messages}
        self.fields: dict[type, list[tuple[str, Any]]] = {}

    @staticmethod
    def _dec_hook(kind: type, value: Any) -> Any:
        if kind is I32 or kind is F32:
            if type(value) is not bytes or len(value) % 4:
                raise ValueError(f"expected {'int32' if kind is I32 else 'float32'} bytes")
            return np.frombuffer(value, "<i4" if kind is I32 else "<f4").view(kind)
        raise NotImplementedError

    def _spec(self, cls: type) -> list[tuple[str, Any]]:
        """Each field's name and default (msgspec.NODEFAULT for a required one)."""
        spec = self.fields.get(cls)
        if spec is None:
            spec = self.fields[cls] = [
                (f.name, f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory())
                for f in msgspec.structs.fields(cls)]
        return spec

    def _wire(self, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return value.tobytes()
        if isinstance(value, msgspec.Struct):
            spec = self._spec(type(value))
            values = [getattr(value, name) for name, _ in spec]
            end = len(values)
            while end and _at_default(values[end - 1], spec[end - 1][1]):
                end -= 1
            return [self._wire(v) for v in values[:end]]
        if isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):
            return [self._wire(v) for v in value]
        return value

    def encode(self, msg: msgspec.Struct) -> bytes:
        name = type(msg).__name__.removeprefix("M")
        return self.packer.encode([PROTOCOL_VERSION, name, *self._wire(msg)])

    def decode(self, data: bytes) -> Any:
        """Only fixarray messages (fewer than 16 fields, as every message is) with a fixstr type name."""
        count, name_len = data[0] - 0x90, data[2] - 0xA0
        if not (2 <= count < 16 and data[1] == PROTOCOL_VERSION and 0 <= name_len < 32):
            raise ValueError("not a message")
        name = data[3:3 + name_len].decode()
        return self.decoders[name].decode(bytes([0x90 + count - 2]) + data[3 + name_len:])


def _at_default(value: Any, default: Any) -> bool:
    if default is msgspec.NODEFAULT:
        return False
    if isinstance(value, np.ndarray):
        return value.size == 0
    if isinstance(default, (list, dict)):
        return type(value) is type(default) and not value
    return type(value) is type(default) and value == default


# ============================================================================ the step of 256 decodes
def messages(rng: np.random.Generator) -> dict[str, tuple[Any, msgspec.Struct]]:
    """Name -> (our message, the same message as msgspec structs)."""
    seq_ids = np.sort(rng.choice(4096, NUM_ROWS, replace=False)).astype("<i4")
    crossing = rng.choice(seq_ids, 4, replace=False)
    blocks = [(int(s), i32([int(b)])) for s, b in zip(crossing, rng.integers(0, 40_000, size=4))]
    plan = StepPlan(1234, [], [], i32([]), i32([]), i32(seq_ids), [NewBlocks(s, b) for s, b in blocks],
                    i32([]), i32([]), [])
    empty = i32([]).view(I32)
    mplan = MStepPlan(1234, [], [], empty, empty, i32(seq_ids).view(I32),
                      [MNewBlocks(s, b.view(I32)) for s, b in blocks], empty, empty, [])

    sampled = i32(rng.integers(0, VOCAB_SIZE, size=NUM_ROWS))
    timings = {"gpu_ms": 6.287, "idle_ms": 0.153, "wait_ms": 6.412, "t_done": 81234.56789}
    result = StepResult(1234, sampled, dict(timings))
    mresult = MStepResult(1234, sampled.view(I32), dict(timings))

    rows = i32(np.sort(rng.choice(NUM_ROWS, NUM_LOGPROB_ROWS, replace=False)))
    arrays = (rows, i32([1] * NUM_LOGPROB_ROWS), i32([TOP_N] * NUM_LOGPROB_ROWS),
              f32(-rng.exponential(1.0, NUM_LOGPROB_ROWS)), i32(rng.integers(1, 6, NUM_LOGPROB_ROWS)),
              i32(rng.integers(0, VOCAB_SIZE, NUM_LOGPROB_ROWS * TOP_N)),
              f32(-rng.exponential(1.0, NUM_LOGPROB_ROWS * TOP_N)))
    kinds = (I32, I32, I32, F32, I32, I32, F32)
    with_logprobs = StepResult(1234, sampled, dict(timings), Logprobs(*arrays))
    mwith_logprobs = MStepResult(1234, sampled.view(I32), dict(timings),
                                 MLogprobs(*(a.view(k) for a, k in zip(arrays, kinds))))
    return {f"StepPlan, {NUM_ROWS} decode rows, 4 NewBlocks": (plan, mplan),
            f"StepResult, {NUM_ROWS} tokens": (result, mresult),
            f"StepResult, {NUM_ROWS} tokens, top-{TOP_N} logprobs of {NUM_LOGPROB_ROWS} rows": (with_logprobs,
                                                                                              mwith_logprobs)}


def same_arrays(ours: Any, theirs: Any) -> bool:
    """Field-by-field equality of one of our messages and its msgspec twin (arrays by bytes and dtype)."""
    for name in type(theirs).__struct_fields__:
        a, b = getattr(ours, name), getattr(theirs, name)
        if isinstance(a, np.ndarray):
            if not (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()):
                return False
        elif isinstance(b, msgspec.Struct):
            if not same_arrays(a, b):
                return False
        elif isinstance(b, list) and b and isinstance(b[0], msgspec.Struct):
            if len(a) != len(b) or not all(same_arrays(x, y) for x, y in zip(a, b)):
                return False
        elif a != b:
            return False
    return True


def median_us(fn: Callable[[], Any], samples: int, calls: int) -> float:
    times = []
    for _ in range(samples):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=101, help="samples per figure (the median is shown)")
    parser.add_argument("--calls", type=int, default=200, help="calls timed together in one sample")
    args = parser.parse_args()
    if args.samples < 1 or args.calls < 1:
        parser.error("--samples and --calls must be at least 1")

    codec = MsgspecCodec([MStepPlan, MStepResult])
    rows = []
    for name, (ours, theirs) in messages(np.random.default_rng(0)).items():
        data = encode(ours)
        if codec.encode(theirs) != data:
            sys.exit(f"{name}: msgspec's bytes differ from ours: the comparison would not be fair")
        if not (same_arrays(decode(data), theirs) and same_arrays(ours, codec.decode(data))):
            sys.exit(f"{name}: a decoder did not give the message back")
        timed = (partial(encode, ours), partial(codec.encode, theirs), partial(decode, data),
                 partial(codec.decode, data))
        times = [median_us(fn, args.samples, args.calls) for fn in timed]
        rows.append((name, len(data), *times))

    print(f"msgspec {msgspec.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}; "
          f"median of {args.samples} x {args.calls} calls, microseconds per call")
    print()
    print("| message | bytes | encode, ours | encode, msgspec | decode, ours | decode, msgspec |")
    print("|---|---|---|---|---|---|")
    for name, size, enc_ours, enc_ms, dec_ours, dec_ms in rows:
        print(f"| {name} | {size:,} | {enc_ours:.1f} | {enc_ms:.1f} | {dec_ours:.1f} | {dec_ms:.1f} |")


if __name__ == "__main__":
    main()
