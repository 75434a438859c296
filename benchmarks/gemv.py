"""Small-batch GEMV (`gpu_kernels/gemv.py`) against cuBLAS (`F.linear`) on the linear layers of Qwen3-0.6B and 8B.

    python benchmarks/gemv.py [--batches 1 2 4 8 16] [--json FILE] [--fused-only | --pdl]

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

Then, at M = 1 (`--fused-only`: these rows alone), what a decode step of one sequence runs since the fusions:
each split layer's GEMV in one launch against the two-launch reduction, and each fused prologue (silu+down,
norm+qkv, norm+gate_up) against the compiled layer (torch.compile, as the model runner runs it) followed by the
GEMV; and the sum over one Qwen3-0.6B decoder layer times 28, unfused (11 launches a layer) against fused (4).

`--pdl`: only each decoder layer's M = 1 GEMV launched plainly and with programmatic dependent launch
(`DELTASERVE_PDL`, gpu_kernels/pdl.py), with the time a batch-1 step's 112 GEMVs would save.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# The repository root must come before benchmarks/, where this file would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.envs import GEMV_MAX_BATCH_DEFAULT  # noqa: E402
from gpu_kernels.gemv import GemvConfig, add_rms_norm_gemv, choose_gemv_config, gemv, silu_and_mul_gemv  # noqa: E402

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


def fused_cases(layer: str, n: int, k: int, config: GemvConfig, device: torch.device, silu_and_mul: Callable,
                add_rms_norm: Callable) -> list[tuple[str, str, Callable, Callable]]:
    """(name, what the unfused function runs, unfused(weight), fused(weight)) for one layer at M = 1; unfused is
    the code before the fusions (two launches where K is split)."""
    eps = 1e-6
    x = torch.randn(1, k, device=device, dtype=DTYPE)
    two = dataclasses.replace(config, one_launch=False)
    cases = [(f"{layer} split-K", "2 launches", lambda w: gemv(x, w, config=two), lambda w: gemv(x, w, config=config))]
    if layer == "down":
        gate_up = torch.randn(1, 2 * k, device=device, dtype=DTYPE)
        cases.append(("silu+down", "silu_and_mul + 2-launch gemv", lambda w: gemv(silu_and_mul(gate_up), w, config=two),
                      lambda w: silu_and_mul_gemv(gate_up, w)))
    if layer in ("qkv", "gate_up"):
        residual = torch.randn(1, k, device=device, dtype=DTYPE)
        norm_weight = torch.rand(k, device=device, dtype=DTYPE) + 0.5
        cases.append((f"norm+{layer}", "add_rms_norm + 2-launch gemv",
                      lambda w: gemv(add_rms_norm(x, residual, norm_weight, eps)[0], w, config=two),
                      lambda w: add_rms_norm_gemv(x, residual, norm_weight, eps, w)[0]))
    return cases


def fused_rows(args: argparse.Namespace, device: torch.device, num_sms: int) -> list[dict]:
    """Time, at M = 1, each Qwen3-0.6B decoder layer's GEMV in one launch and in two, and each fused prologue
    against the compiled layer + GEMV; print them and one decode step's 28 layers unfused and fused."""
    from workers.layers.activation import silu_and_mul
    from workers.layers.fused import enable_compilation
    from workers.layers.norm import add_rms_norm

    enable_compilation(True)  # the unfused layers as the model runner runs them: torch.compile'd
    shapes = {layer: (n, k) for model, layer, n, k in SHAPES if model == "0.6B" and layer != "lm_head"}
    print("\nQwen3-0.6B decode layers at M=1, us (median of CUDA-graph replays; fused: one kernel)")
    print(f"{'layer':14} {'N x K':>13} {'unfused':>8} {'fused':>8} {'gain':>6}  unfused is")
    rows: list[dict] = []
    timings: dict[str, tuple[float, float]] = {}
    for layer, (n, k) in shapes.items():
        weight_bytes = n * k * DTYPE.itemsize
        copies = max(1, min(args.calls, -(-L2_DEFEAT_BYTES // weight_bytes)))
        weights = [torch.randn(n, k, device=device, dtype=DTYPE) * k**-0.5 for _ in range(copies)]
        config = choose_gemv_config(1, n, k, num_sms)
        cases = fused_cases(layer, n, k, config, device, silu_and_mul, add_rms_norm)
        for name, unfused_is, unfused, fused in cases:
            same = torch.equal(unfused(weights[0]), fused(weights[0]))
            unfused_us = time_calls(unfused, weights, args.calls, args.reps)
            fused_us = time_calls(fused, weights, args.calls, args.reps)
            timings[name] = (unfused_us, fused_us)
            rows.append(dict(model="0.6B", layer=name, n=n, k=k, m=1, kernel="fused", us=fused_us,
                             unfused_us=unfused_us, unfused=unfused_is, same_bits=same, split_k=config.split_k))
            print(f"{name:14} {n:>6}x{k:<6} {unfused_us:8.1f} {fused_us:8.1f} {unfused_us / fused_us:5.2f}x  "
                  f"{unfused_is} (split_k {config.split_k}; {'same bits' if same else 'other bits'})")
        del weights
        torch.cuda.empty_cache()
    enable_compilation(False)
    # One decoder layer's GEMVs and the layers fused into them (attention and RoPE not included).
    unfused = sum(timings[name][0] for name in ("norm+qkv", "o split-K", "norm+gate_up", "silu+down"))
    fused = sum(timings[name][1] for name in ("norm+qkv", "o split-K", "norm+gate_up", "silu+down"))
    print(f"28 layers x (norm+qkv, o, norm+gate_up, silu+down): unfused {28 * unfused:.1f} us, fused "
          f"{28 * fused:.1f} us ({unfused / fused:.2f}x)")
    return rows


def pdl_rows(args: argparse.Namespace, device: torch.device, num_sms: int) -> list[dict]:
    """Each Qwen3-0.6B decoder layer's GEMV at M = 1 (one launch, as a decode step runs it) launched plainly and
    with programmatic dependent launch (DELTASERVE_PDL, gpu_kernels/pdl.py): the time of one call in a graph of
    `args.calls` calls, and whether the outputs are the same bits."""
    from gpu_kernels import pdl

    shapes = {layer: (n, k) for model, layer, n, k in SHAPES if model == "0.6B" and layer != "lm_head"}
    print("\nQwen3-0.6B decode GEMVs at M=1 without and with programmatic dependent launch, us a call")
    print(f"{'layer':8} {'N x K':>13} {'plain':>8} {'PDL':>8} {'gain':>6}")
    rows, saved = [], 0.0
    previous = os.environ.get("DELTASERVE_PDL")
    for layer, (n, k) in shapes.items():
        weight_bytes = n * k * DTYPE.itemsize
        copies = max(1, min(args.calls, -(-L2_DEFEAT_BYTES // weight_bytes)))
        weights = [torch.randn(n, k, device=device, dtype=DTYPE) * k**-0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=device, dtype=DTYPE)
        config = choose_gemv_config(1, n, k, num_sms)
        outputs, us = [], []
        for on in (False, True):
            os.environ["DELTASERVE_PDL"] = "1" if on else "0"
            pdl._requested.cache_clear()
            outputs.append(gemv(x, weights[0], config=config))
            us.append(time_calls(lambda w, x=x, c=config: gemv(x, w, config=c), weights, args.calls, args.reps))
        same = torch.equal(outputs[0], outputs[1])
        saved += STEP_LAYERS[layer] * (us[0] - us[1])
        rows.append(dict(model="0.6B", layer=layer, n=n, k=k, m=1, kernel="pdl", us=us[1], plain_us=us[0],
                         same_bits=same))
        print(f"{layer:8} {n:>6}x{k:<6} {us[0]:8.2f} {us[1]:8.2f} {us[0] / us[1]:5.2f}x  "
              f"{'same bits' if same else 'OTHER BITS'}")
        del weights
        torch.cuda.empty_cache()
    if previous is None:
        os.environ.pop("DELTASERVE_PDL", None)
    else:
        os.environ["DELTASERVE_PDL"] = previous
    pdl._requested.cache_clear()
    print(f"a batch-1 decode step's 112 GEMVs: {saved:.1f} us saved by PDL")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=40, help="calls per CUDA graph")
    parser.add_argument("--reps", type=int, default=15, help="graph replays timed per measurement")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--fused-only", action="store_true", help="only the M = 1 rows of the fused decode layers")
    parser.add_argument("--pdl", action="store_true",
                        help="only the M = 1 GEMVs without and with programmatic dependent launch (DELTASERVE_PDL)")
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
    if args.fused_only or args.pdl:
        rows += fused_rows(args, device, num_sms) if args.fused_only else pdl_rows(args, device, num_sms)
        print(f"({time.perf_counter() - started:.0f} s)")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
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
    rows += fused_rows(args, device, num_sms)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
