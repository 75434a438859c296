"""Small-batch GEMV (`kernels/gemv.py`) against cuBLAS (`F.linear`) on the linear layers of Qwen3-0.6B and 8B.

    python benchmarks/gemv.py [--batches 1 2 4 8 16] [--json FILE]

For each weight shape (N outputs x K inputs, bf16) and batch M: the median microseconds of one call, and the
weight bytes read per second (TB/s; the H200 copies at about 4.25). Timing mirrors a decode step under CUDA
graphs: a graph of `--calls` back-to-back calls, each on another copy of the weight (as many copies as make
256 MiB, so the H200's 50 MiB L2 never holds the next call's weight, as in a model whose 28 layers stream by),
replayed `--reps` times between CUDA events; the median replay over the calls in it is one call's time. Each
result is checked against a float32 torch product first.

At M = 1 the tensor-core path (`use_dot`) is timed too, next to the element-wise path the heuristic picks, to
show whether that choice is right. The last lines add up one Qwen3-0.6B decode step's linear layers (28 x
(qkv + o + gate_up + down) + the LM head) for each M, ours against cuBLAS, and name the largest M up to which
ours wins at every batch: the value for DELTASERVE_GEMV_MAX_BATCH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The repository root must come before benchmarks/, where this file would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.envs import GEMV_MAX_BATCH_DEFAULT  # noqa: E402
from kernels.gemv import choose_gemv_config, gemv  # noqa: E402

DTYPE = torch.bfloat16
L2_DEFEAT_BYTES = 256 << 20
# (model, layer, N, K); the 0.6B layers' counts per decode step are in STEP_LAYERS.
SHAPES = [
    ("0.6B", "qkv", 4096, 1024),
    ("0.6B", "o", 1024, 2048),
    ("0.6B", "gate_up", 6144, 1024),
    ("0.6B", "down", 1024, 3072),
    ("0.6B", "lm_head", 151936, 1024),
    ("8B", "qkv", 6144, 4096),
    ("8B", "o", 4096, 4096),
    ("8B", "gate_up", 24576, 4096),
    ("8B", "down", 4096, 12288),
]
STEP_LAYERS = {"qkv": 28, "o": 28, "gate_up": 28, "down": 28, "lm_head": 1}


def time_calls(fn, weights: list[torch.Tensor], calls: int, reps: int) -> float:
    """Median microseconds of one `fn(weight)` call in a CUDA graph of `calls` calls over the weight copies."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Largest |y - ref| over the largest |ref|, ref the float32 product (should be below bf16's 2^-8)."""
    ref = x.float() @ w.float().T
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=40, help="calls per CUDA graph")
    parser.add_argument("--reps", type=int, default=15, help="graph replays timed per measurement")
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemv.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name(device)}, {num_sms} SMs, torch {torch.__version__}; bf16, times in us "
          f"(median of {args.reps} replays of {args.calls} calls), TB/s of weight bytes")
    header = f"{'model':5} {'layer':8} {'N x K':>13} {'M':>3} {'ours':>8} {'TB/s':>5} {'cuBLAS':>8} {'TB/s':>5} " \
             f"{'winner':>7}  config (block_n, block_k, split_k, dot)"
    print(header)
    rows: list[dict] = []
    started = time.perf_counter()
    for model, layer, n, k in SHAPES:
        weight_bytes = n * k * DTYPE.itemsize
        copies = max(1, min(args.calls, -(-L2_DEFEAT_BYTES // weight_bytes)))
        weights = [torch.randn(n, k, device=device, dtype=DTYPE) * k**-0.5 for _ in range(copies)]
        for m in args.batches:
            x = torch.randn(m, k, device=device, dtype=DTYPE)
            heuristic = choose_gemv_config(m, n, k, num_sms)
            configs = [("ours", heuristic)]
            if not heuristic.use_dot:  # the tensor-core path as it runs at M = 2
                configs.append(("ours-dot", choose_gemv_config(2, n, k, num_sms)))
            cublas_us = time_calls(lambda w, x=x: F.linear(x, w), weights, args.calls, args.reps)
            for name, config in configs:
                error = check(gemv(x, weights[0], config=config), x, weights[0])
                us = time_calls(lambda w, x=x, c=config: gemv(x, w, config=c), weights, args.calls, args.reps)
                row = dict(model=model, layer=layer, n=n, k=k, m=m, kernel=name, us=us, tb_s=weight_bytes / us / 1e6,
                           cublas_us=cublas_us, cublas_tb_s=weight_bytes / cublas_us / 1e6, max_rel_error=error,
                           config=dataclasses.asdict(config))
                rows.append(row)
                winner = name if us < cublas_us else "cuBLAS"
                flag = "" if error < 2.0**-7 else f"  WRONG: relative error {error:.2e}"
                print(f"{model:5} {layer:8} {n:>6}x{k:<6} {m:>3} {us:8.1f} {row['tb_s']:5.2f} {cublas_us:8.1f} "
                      f"{row['cublas_tb_s']:5.2f} {winner:>7}  ({config.block_n}, {config.block_k}, "
                      f"{config.split_k}, {config.use_dot}){flag}")
        del weights
        torch.cuda.empty_cache()

    print("\nQwen3-0.6B linear layers of one decode step (28 layers + LM head), us:")
    best_max_batch = 0
    still_winning = True
    for m in args.batches:
        ours = sum(r["us"] * STEP_LAYERS[r["layer"]] for r in rows if r["model"] == "0.6B" and r["m"] == m
                   and r["kernel"] == "ours")
        cublas = sum(r["cublas_us"] * STEP_LAYERS[r["layer"]] for r in rows if r["model"] == "0.6B" and r["m"] == m
                     and r["kernel"] == "ours")
        print(f"  M={m:<3} ours {ours:8.1f}   cuBLAS {cublas:8.1f}   ({cublas / ours:.2f}x)")
        still_winning = still_winning and ours < cublas
        if still_winning:
            best_max_batch = m
    print(f"largest M up to which ours wins at every batch measured: {best_max_batch} "
          f"(DELTASERVE_GEMV_MAX_BATCH; default {GEMV_MAX_BATCH_DEFAULT})")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
