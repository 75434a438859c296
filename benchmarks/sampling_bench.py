"""Device time of the fused processed-row sampler (gpu_kernels/processed_sampling.py) against today's path, at
Qwen3's vocabulary in bf16.

    python benchmarks/sampling_bench.py [--batches 1 64 256] [--calls 10] [--replays 20]
    python benchmarks/sampling_bench.py --dry-run    # CPU, Triton interpreter, tiny sizes: runs every path once
    python benchmarks/sampling_bench.py --kernels target filtered --batches 256   # device time of each kernel
    python benchmarks/sampling_bench.py --kernels target --launch sample:num_warps=8,block=1024 prepare:num_stages=1

Cases (every row of a batch alike, temperature 0.6):
  plain        temperature only: today `sample_candidates`; new, the same scan inside processed_sample
  filtered     throughput.py's --filtered mix: top_p 0.9, top_k 50, repetition 1.1, logprobs 5
  top_p        top_p 0.95 alone
  top_p flat   top_p 0.95 on flat logits: the threshold lies in the bulk, so the pivot passes read whole rows
  target       issue 31's target (at most 0.25 ms at batch 256): top_k 50, top_p 0.9, min_p 0.05, repetition 1.1,
               frequency 0.5, presence 0.5, logprobs 5
  everything   top_k 50, top_p 0.9, min_p 0.05, repetition 1.1, frequency 0.5, presence 0.5, three logit-bias
               entries and a ban, a grammar bitmask allowing half the vocabulary, logprobs 5
Today's path is what the engine runs for processed rows at TP=1: a float32 copy of the rows,
workers/logits_processing.py's `LogitsProcessor.apply`, `sample_candidates` at temperature 1 (0 for greedy) and
`token_logprobs` for the logprobs (its inputs uploaded beforehand, as the worker does before the forward).

Times are device time per call: CUDA events around replays of a CUDA graph holding `--calls` calls (so host
launch cost is excluded), the median of `--replays`. The same logits are sampled again and again, so at batch 1
and 64 they sit in L2; at 256 (78 MB of bf16) mostly not. Logits are LM-like: randn * 2 with 20 tokens raised
by 8 (a peaked top), or randn * 0.5 for the flat case. A path that cannot be captured is timed eagerly and marked.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

# The repository root must come before benchmarks/, and the interpreter must be chosen before triton is imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "--kernels" in sys.argv:
    os.environ["DELTASERVE_PDL"] = "0"  # with PDL a kernel's span would include its wait for the one before

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.protocol import SamplingOptions  # noqa: E402
from gpu_kernels.processed_sampling import (  # noqa: E402
    BLOCK,
    LAUNCH,
    ProcessedSamplingWorkspace,
    compile_for_batches,
    processed_sample,
)
from gpu_kernels.sampling import sample_candidates  # noqa: E402
from gpu_kernels.sampling_inputs import PenaltyBits, from_processing  # noqa: E402
from workers.input_batch import ReqState  # noqa: E402
from workers.logits_processing import LogitsProcessor, build_processing  # noqa: E402

TEMPERATURE = 0.6
NUM_TOP = 5
PROMPT, OUTPUT = 100, 20  # tokens each request has seen and generated (the penalties' state)
CASES = {
    "plain": None,
    "filtered": SamplingOptions(top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=5),
    "top_p": SamplingOptions(top_p=0.95),
    "top_p flat": SamplingOptions(top_p=0.95),
    "target": SamplingOptions(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5,
                              presence_penalty=0.5, logprobs=5),
    "everything": SamplingOptions(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5,
                                  presence_penalty=0.5, logit_bias={11: 2.0, 300: -1.0, 450: 3.0}, bad_words=[[77]],
                                  logprobs=5),
}


def lm_logits(batch: int, vocab: int, flat: bool, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, vocab, generator=g) * (0.5 if flat else 2.0)
    if not flat:
        top = torch.randint(0, vocab, (batch, 20), generator=g)
        x.scatter_add_(1, top, torch.full(top.shape, 8.0))
    return x.to(torch.bfloat16).to(device)


@dataclasses.dataclass
class Case:
    new: Callable[[], object]
    today: Callable[[], object]


def build(name: str, batch: int, vocab: int, device: str, chunk_size: int | None = None) -> Case:
    """Both paths for `batch` rows of case `name`, inputs uploaded (`chunk_size`: the fused sampler's, None: its
    own choice for the batch)."""
    logits = lm_logits(batch, vocab, name == "top_p flat", device)
    temps = np.full(batch, TEMPERATURE, np.float32)
    seeds = torch.arange(batch, dtype=torch.int64, device=device) * 7919 + 1
    options = CASES[name]
    rng = np.random.default_rng(1)
    states = []
    for i in range(batch):
        st = ReqState(i, TEMPERATURE, None, options)
        st.row, st.num_prompt_tokens = i, PROMPT
        st.tokens = rng.integers(0, vocab, PROMPT + OUTPUT).astype(np.int32)
        st.num_tokens = st.num_tokens_cpu = PROMPT + OUTPUT
        states.append(st)
    h = build_processing(states, temps, vocab)
    grammar = options is not None and name == "everything"
    if h is not None and grammar:
        h = dataclasses.replace(h, grammar_rows=np.arange(batch, dtype=np.int64))
    words = -(-vocab // 32)
    bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, (batch, words)).astype(np.int32)).to(device)
    params, sparse = from_processing(h, temps, vocab, device)
    bits = PenaltyBits(device, batch, vocab)
    bits.reset_rows([st for st in states if st.penalized])
    ws = ProcessedSamplingWorkspace(device, vocab, max_scratch_rows=batch)
    last = torch.zeros(batch, dtype=torch.int64, device=device)
    new_inputs = {"penalties": bits if h is not None and h.uses_repetition | h.uses_frequency_presence else None,
                  "bitmask": bitmask if grammar else None, "sparse": sparse if h is not None and len(h.bias_rows)
                  else None, "last_sampled": last, "num_top": NUM_TOP}

    def new() -> object:
        return processed_sample(logits, params, seeds, workspace=ws, chunk_size=chunk_size, **new_inputs)

    temps_dev = torch.from_numpy(temps).to(device)
    if h is None:
        return Case(new, lambda: sample_candidates(logits, temps_dev, seeds))
    proc = LogitsProcessor(torch.device(device), batch, vocab)
    proc.penalties.reset_rows([st for st in states if st.penalized])
    d = proc.upload(h)
    if grammar:
        d.bitmask = bitmask

    def today() -> object:
        x = proc.apply(logits.float(), d, last)
        tokens = sample_candidates(x, d.f["sample_temperatures"], seeds)[1]
        return tokens, proc.logprobs(x, d, tokens)

    return Case(new, today)


def device_us(fn: Callable[[], object], calls: int, replays: int) -> tuple[float, bool]:
    """(median device microseconds per call, whether a CUDA graph held the calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run, captured = graph.replay, True
    except RuntimeError:
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(calls):
                fn()
        captured = False
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times), captured


def kernel_breakdown(fn: Callable[[], object], calls: int) -> list[tuple[str, float]]:
    """(kernel name, mean device microseconds per call) of `calls` eager calls under torch.profiler, slowest
    first, with "total" last. PDL is off in this mode (see the imports), so spans do not overlap."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.split("(")[0][:48]
            spans[name] = spans.get(name, 0.0) + event.time_range.elapsed_us() / calls
    rows = sorted(spans.items(), key=lambda kv: -kv[1])
    return rows + [("total", sum(spans.values()))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, vocabulary 512, batch 2; no timing")
    ap.add_argument("--kernels", nargs="+", choices=list(CASES), metavar="CASE",
                    help="instead of the table: each fused kernel's device time for these cases (PDL off)")
    ap.add_argument("--launch", nargs="+", default=[], metavar="KERNEL:KEY=VALUE,...",
                    help=f"override the fused kernels' launch settings (gpu_kernels/processed_sampling.py's LAUNCH "
                         f"and BLOCK: {', '.join(LAUNCH)}; keys num_warps, num_stages, and block for the kernels that "
                         f"have one: {', '.join(BLOCK)}; a block larger than the chunk is the chunk)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="the table's cases")
    ap.add_argument("--fused-only", action="store_true", help="the table without today's path")
    ap.add_argument("--chunk", type=int, default=None, help="the fused sampler's chunk size (default: its choice)")
    args = ap.parse_args()
    for spec in args.launch:
        kernel, _, settings = spec.partition(":")
        if kernel not in LAUNCH or not settings:
            ap.error(f"--launch {spec}: expected KERNEL:KEY=VALUE,... with KERNEL one of {', '.join(LAUNCH)}")
        for item in settings.split(","):
            key, _, value = item.partition("=")
            keys = ("num_warps", "num_stages", "block") if kernel in BLOCK else ("num_warps", "num_stages")
            if key not in keys or not value.isdigit():
                ap.error(f"--launch {spec}: {item!r} is not one of {', '.join(k + '=N' for k in keys)} (for {kernel})")
            number = int(value)
            power_of_two = number > 0 and not number & (number - 1)
            if key == "num_warps" and not (power_of_two and number <= 32):
                ap.error(f"--launch {spec}: num_warps must be a power of two from 1 to 32, got {number}")
            if key == "num_stages" and number < 1:
                ap.error(f"--launch {spec}: num_stages must be at least 1, got {number}")
            if key == "block" and not (power_of_two and number >= 16):
                ap.error(f"--launch {spec}: block must be a power of two of at least 16 entries, got {number}")
            if key == "block":
                BLOCK[kernel] = number
            else:
                LAUNCH[kernel][key] = number
    if args.launch:
        print("launch settings:", LAUNCH, "blocks:", BLOCK)
    if args.dry_run:
        for name in CASES:
            case = build(name, 2, 512, "cpu")
            case.new()
            case.today()
            print(f"{name}: both paths ran")
        return
    if not torch.cuda.is_available():
        sys.exit("sampling_bench.py needs a CUDA GPU (or --dry-run)")
    compile_for_batches(max(args.batches), torch.bfloat16, ProcessedSamplingWorkspace("cuda", args.vocab),
                        num_top=NUM_TOP)
    print(f"vocabulary {args.vocab}, bf16 logits, {torch.cuda.get_device_name()}; device time per call")
    if args.kernels:
        for name in args.kernels:
            for batch in args.batches:
                print(f"{name}, batch {batch} (us per call, eager, PDL off):")
                for kernel, us in kernel_breakdown(build(name, batch, args.vocab, "cuda", args.chunk).new,
                                                     args.calls):
                    print(f"  {kernel:<50} {us:8.1f}")
        return
    print("| case | batch | fused (us) | today (us) | today / fused |")
    print("|---|---|---|---|---|")
    for name in args.cases:
        for batch in args.batches:
            case = build(name, batch, args.vocab, "cuda", args.chunk)
            new, new_graph = device_us(case.new, args.calls, args.replays)
            mark = "" if new_graph else " (eager)"
            if args.fused_only:
                print(f"| {name} | {batch} | {new:.1f}{mark} | - | - |")
            else:
                old, old_graph = device_us(case.today, args.calls, args.replays)
                print(f"| {name} | {batch} | {new:.1f}{mark} | {old:.1f}{'' if old_graph else ' (eager)'} | "
                      f"{old / new:.2f}x |")
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
