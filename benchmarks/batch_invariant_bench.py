"""The batch-invariant matmul (`gpu_kernels/batch_invariant.py`) against cuBLAS (`F.linear`) on Qwen3-0.6B's layers.

    python benchmarks/batch_invariant_bench.py [--batches 1 8 32 256 2048] [--dtype bf16|fp16|fp32] [--sweep]
    python benchmarks/batch_invariant_bench.py --small-sweep | --graph-sweep [--dtype ...]

Needs a CUDA GPU.

For each weight shape (N outputs x K inputs) and batch M: the median microseconds of one call of ours and of
cuBLAS, and their ratio (ours / cuBLAS: 2.0 means ours takes twice as long). Times are medians of
`triton.testing.do_bench`, which clears the L2 cache before every call, so the weight comes from HBM as in a model
whose 28 layers stream by; launch latency is included for both. The "bits" column says whether row 0 of the batch
has the bits of that row computed alone, for ours (must be yes) and for cuBLAS. The last lines add the layers up as
one Qwen3-0.6B forward (28 x (qkv + o + gate_up + down) + the LM head) at each M.

`--sweep`: the same forward totals for other launch configurations of ours (tiles, and K split every 128 to
4096 features), each one used for every M, to show why `HOPPER_CONFIGS` holds what it does.
`--small-sweep`: at M = 1 and 8 (a decode step of few rows), the forward totals of other tiles, warps and stages of
the K split every 512 features, each with the persistent grid at 1, 2 and 4 programs per SM; "bits" says whether
every layer's output equals the default configuration's (it must: only the tile and the grid differ).
`--graph-sweep`: the few-row tiles timed the way a decode step runs them: one CUDA graph holding a whole forward's
linear layers (28 distinct weights of each shape, so nothing stays in L2 between layers, and the LM head), replayed;
launch latency between kernels counts as in the engine, the L2 is not cleared by hand, and timing noise is that of
graph replays (a few microseconds). Beside them, in the same harness: the default mode's GEMV and cuBLAS. The last
`best tile: ...` line (printed once M = 1 is done) is the fastest configuration at M = 1 that gives the default's
bits, in the form DELTASERVE_MATMUL_SMALL_TILE takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

# The repository root must come before benchmarks/, where this file would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_kernels.batch_invariant import HOPPER_CONFIGS, MatmulConfig, persistent_matmul  # noqa: E402
from gpu_kernels.gemv import gemv  # noqa: E402

# (layer, N, K, times per forward)
SHAPES = [
    ("qkv", 4096, 1024, 28),
    ("o", 1024, 2048, 28),
    ("gate_up", 6144, 1024, 28),
    ("down", 1024, 3072, 28),
    ("lm_head", 151936, 1024, 1),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWEEP_CONFIGS = [
    MatmulConfig(block_m=128, block_n=128, block_k=64, k_split=128, num_warps=8, num_stages=3),
    MatmulConfig(block_m=128, block_n=128, block_k=64, k_split=256, num_warps=8, num_stages=3),
    MatmulConfig(block_m=128, block_n=128, block_k=64, k_split=512, num_warps=8, num_stages=3),
    MatmulConfig(block_m=128, block_n=128, block_k=64, k_split=1024, num_warps=8, num_stages=3),
    MatmulConfig(block_m=128, block_n=128, block_k=64, k_split=4096, num_warps=8, num_stages=3),  # no split here
    MatmulConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
]


def microseconds(fn, *args, **kwargs) -> float:
    """The median time of `fn(*args, **kwargs)`, L2 cleared before each call."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median") * 1e3


def time_layers(batches: list[int], dtype: torch.dtype) -> None:
    print(f"{'layer':>8} {'N':>7} {'K':>5} {'M':>5} {'ours us':>9} {'cuBLAS us':>9} {'ratio':>6}  bits as alone "
          f"(ours, cuBLAS)")
    totals = {m: [0.0, 0.0] for m in batches}
    for name, n, k, count in SHAPES:
        weight = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
        for m in batches:
            x = torch.randn(m, k, device="cuda").to(dtype)
            ours = microseconds(persistent_matmul, x, weight)
            cublas = microseconds(F.linear, x, weight)
            ours_same = torch.equal(persistent_matmul(x, weight)[0], persistent_matmul(x[:1], weight)[0])
            cublas_same = torch.equal(F.linear(x, weight)[0], F.linear(x[:1], weight)[0])
            totals[m][0] += count * ours
            totals[m][1] += count * cublas
            print(f"{name:>8} {n:>7} {k:>5} {m:>5} {ours:>9.1f} {cublas:>9.1f} {ours / cublas:>6.2f}  "
                  f"{'yes' if ours_same else 'NO'}, {'yes' if cublas_same else 'no'}")
    print("\nOne Qwen3-0.6B forward's linear layers (28 x (qkv + o + gate_up + down) + LM head):")
    for m, (ours, cublas) in totals.items():
        print(f"  M={m:>5}: ours {ours / 1e3:8.2f} ms, cuBLAS {cublas / 1e3:8.2f} ms, ratio {ours / cublas:.2f}")


def sweep(batches: list[int], dtype: torch.dtype) -> None:
    weights = {(n, k): (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype) for _, n, k, _ in SHAPES}
    print("\nForward totals (ms) per configuration (block_m x block_n x block_k, warps, stages), each for every M:")
    print(f"{'config':>28} " + " ".join(f"{'M=' + str(m):>9}" for m in batches))
    cublas = {m: 0.0 for m in batches}
    for m in batches:
        for _, n, k, count in SHAPES:
            x = torch.randn(m, k, device="cuda").to(dtype)
            cublas[m] += count * microseconds(F.linear, x, weights[(n, k)])
    print(f"{'cuBLAS':>28} " + " ".join(f"{cublas[m] / 1e3:>9.2f}" for m in batches))
    for config in SWEEP_CONFIGS:
        row = []
        for m in batches:
            total = 0.0
            for _, n, k, count in SHAPES:
                x = torch.randn(m, k, device="cuda").to(dtype)
                total += count * microseconds(persistent_matmul, x, weights[(n, k)], config=config)
            row.append(total)
        name = (f"{config.block_m}x{config.block_n}x{config.block_k} k{config.k_split} w{config.num_warps} "
                f"s{config.num_stages}")
        print(f"{name:>28} " + " ".join(f"{t / 1e3:>9.2f}" for t in row))


SMALL_TILES = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 64, 4, 6), (16, 128, 4, 4), (16, 64, 2, 4), (16, 32, 2, 6)]


def small_sweep(dtype: torch.dtype) -> None:
    weights = {(n, k): (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype) for _, n, k, _ in SHAPES}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_k = HOPPER_CONFIGS[dtype][0][1].block_k
    print("\nSmall batches: forward totals (ms), K split 512; tile block_m x block_n, warps, stages; programs per SM")
    for m in (1, 8):
        xs = {k: torch.randn(m, k, device="cuda").to(dtype) for _, _, k, _ in SHAPES}
        reference = {(n, k): persistent_matmul(xs[k], w) for (n, k), w in weights.items()}
        for block_m, block_n, warps, stages in SMALL_TILES:
            config = MatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k, k_split=512, num_warps=warps,
                                  num_stages=stages)
            for per_sm in (1, 2, 4):
                total, same = 0.0, True
                for _, n, k, count in SHAPES:
                    args = (xs[k], weights[(n, k)])
                    total += count * microseconds(persistent_matmul, *args, config=config, num_programs=per_sm * sms)
                    same &= torch.equal(persistent_matmul(*args, config=config, num_programs=per_sm * sms),
                                        reference[(n, k)])
                print(f"  M={m} {block_m}x{block_n} w{warps} s{stages} x{per_sm}: {total / 1e3:6.3f} ms, bits "
                      f"{'same' if same else 'DIFFER'}")


# (block_n, warps, stages): narrow tiles of 4 warps at every depth, and a few others
GRAPH_TILES = [(32, 4, 3), (32, 4, 4), (32, 4, 6), (64, 4, 3), (64, 4, 4), (64, 4, 6), (32, 2, 4), (64, 2, 4),
               (128, 4, 4)]
GRAPH_PER_SM = (1, 2, 4, 8)


def graph_forward_ms(run, replays: int = 20, repeats: int = 7) -> float:
    """Milliseconds per call of `run` replayed in a CUDA graph (median of `repeats` timings of `replays` replays)."""
    run()  # compiles, and allocates the split counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


def graph_sweep(dtype: torch.dtype) -> None:
    layers = [(n, k, [(torch.randn(n, k, device="cuda") * k**-0.5).to(dtype) for _ in range(count)])
              for _, n, k, count in SHAPES]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = HOPPER_CONFIGS[dtype][0][1]

    def forward(m: int, linear):
        xs = {k: torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(k)).to(dtype)
              for _, k, _ in layers}

        def run():
            return [linear(xs[k], w) for _, k, ws in layers for w in ws]
        return run

    def matmul_with(config: MatmulConfig):
        return lambda x, w: persistent_matmul(x, w, config=config)

    print(f"\nOne forward's linear layers in a CUDA graph (ms), {sms} SMs; default few-row tile {default}")
    best: dict[int, tuple[float, MatmulConfig]] = {}
    ranked: list[tuple[float, MatmulConfig]] = []  # M = 1's configurations, fastest first; the larger M try 3
    for m in (1, 4, 16):
        reference = forward(m, matmul_with(default))()
        print(f"  M={m}: default mode GEMV {graph_forward_ms(forward(m, gemv)):.3f}, cuBLAS "
              f"{graph_forward_ms(forward(m, F.linear)):.3f}, ours as configured "
              f"{graph_forward_ms(forward(m, matmul_with(default))):.3f}")
        configs = [c for _, c in ranked[:3]] if m > 1 else [
            dataclasses.replace(default, block_n=block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
            for block_n, warps, stages in GRAPH_TILES for per_sm in GRAPH_PER_SM]
        results = []
        for config in configs:
            run = forward(m, matmul_with(config))
            same = all(torch.equal(a, b) for a, b in zip(run(), reference))
            ms = graph_forward_ms(run)
            print(f"    M={m} block_n {config.block_n:>3} w{config.num_warps} s{config.num_stages} "
                  f"x{config.programs_per_sm}: {ms:.3f} ms, bits {'same' if same else 'DIFFER'}", flush=True)
            if same:
                results.append((ms, config))
        if m == 1:
            ranked = sorted(results, key=lambda r: r[0])
            print_best_tile(ranked[0][1])
        best[m] = min(results, key=lambda r: r[0])
    print(f"fastest at M=1: {best[1][0]:.3f} ms; at M=4 {best[4][0]:.3f}, M=16 {best[16][0]:.3f}")


def print_best_tile(config: MatmulConfig) -> None:
    print(f"best tile: block_n={config.block_n},num_warps={config.num_warps},num_stages={config.num_stages},"
          f"programs_per_sm={config.programs_per_sm}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Needs a CUDA GPU.")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 256, 2048],
                        help="batch sizes M of the per-layer table and --sweep (each >= 1)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="of x and the weights")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    modes.add_argument("--small-sweep", action="store_true",
                       help="only time small-batch tiles and grid sizes at M = 1 and 8 (--batches unused)")
    modes.add_argument("--graph-sweep", action="store_true",
                       help="only time few-row tiles and grids on a whole forward in a CUDA graph (--batches unused)")
    args = parser.parse_args()
    if min(args.batches) < 1:
        parser.error(f"--batches must be >= 1, got {min(args.batches)}")
    if not torch.cuda.is_available():
        sys.exit(f"{parser.prog}: needs a CUDA GPU, and torch sees none")
    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, our configuration {HOPPER_CONFIGS[dtype]}")
    if args.graph_sweep:
        graph_sweep(dtype)
        return
    if args.small_sweep:
        small_sweep(dtype)
        return
    time_layers(args.batches, dtype)
    if args.sweep:
        sweep(args.batches, dtype)


if __name__ == "__main__":
    main()
