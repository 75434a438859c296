"""All-reduce on N GPUs of one host: NCCL, PyTorch symmetric memory's one-shot kernel, and ours
(gpu_kernels/all_reduce.py, what workers/parallel.py uses), per call, inside CUDA graphs as a decode
step runs them; and what a decoder layer really does after each row-parallel layer: our all-reduce
followed by the residual add + RMSNorm (compiled, as the model runs it) against the kernel that
fuses all three.

For each size (rows x hidden in bf16) every rank sums random tensors of a known seed with each
method; each result is checked against the float64 reference, then a CUDA graph of `--calls`
back-to-back calls is replayed `--replays` times and the mean time per call printed. Before that,
our kernel runs a stress sequence: plain and fused calls of random sizes, some eager and some in
CUDA graphs of odd lengths, replayed in between, every result checked (its buffers are reused by
epoch parity across all of these).

    python benchmarks/allreduce.py [--world-size 2] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_ROWS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 8192)


def _inputs(rank: int, rows: int, hidden: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rows + rank)
    return torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)


EPS = 1e-6


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def check_and_time(rank: int, world_size: int, init_method: str, rows_list: tuple[int, ...], hidden: int,
                   calls: int, replays: int, results: dict) -> None:
    """Run on every rank (torch.multiprocessing.spawn); rank 0 fills `results` {rows: {method: us}}.

    Raises AssertionError if a method's sum differs from the float64 sum by more than bf16
    rounding of the result allows.
    """
    import workers.parallel as parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel.init_tensor_parallel(rank, world_size, init_method, device)
    peer = parallel._peer_all_reduce
    assert peer is not None, "peer-memory all-reduce did not start"
    _stress(rank, world_size, peer, hidden, device)

    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    torch_buffer = symm_mem.empty(peer.max_bytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(torch_buffer, group_name)

    from workers.layers.fused import enable_compilation
    from workers.layers.norm import add_rms_norm

    enable_compilation(True)  # add_rms_norm through torch.compile, as in the model

    def nccl(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def torch_one_shot(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        staging = torch_buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", group_name)

    def ours_then_norm(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(peer(x), residual, weight, EPS)[0]

    def fused(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return peer.add_rms_norm(x, residual, weight, EPS)[0]

    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(device, torch.bfloat16)
    methods = {"nccl": nccl, "torch one-shot": torch_one_shot, "ours": lambda x, residual: peer(x),
               "ours + norm": ours_then_norm, "fused norm": fused}
    for rows in rows_list:
        x = _inputs(rank, rows, hidden, device)
        residual = _inputs(-1, rows, hidden, device)  # the same on every rank
        expected = sum(_inputs(r, rows, hidden, device).double() for r in range(world_size))
        tol = expected.abs().max().item() * 2**-7 + 1e-3  # one bf16 rounding of the result, plus slack
        expected_norm = _rms_norm(expected + residual.double(), weight.double())
        # the sum and the residual add are rounded to bf16 before the norm: a few bf16 steps
        tol_norm = expected_norm.abs().max().item() * 2**-5 + 1e-2
        row = {}
        for name, fn in methods.items():
            if name != "nccl" and x.numel() * x.element_size() > peer.max_bytes:
                row[name] = None
                continue
            ref, ref_tol = (expected_norm, tol_norm) if "norm" in name else (expected, tol)
            got = fn(x.clone(), residual.clone())
            err = (got.double() - ref).abs().max().item()
            assert err <= ref_tol, f"{name} rows={rows}: max error {err} > {ref_tol}"
            bufs = [(x.clone(), residual.clone()) for _ in range(calls)]
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for b in bufs[:2]:
                    fn(*b)  # warm up outside the graph (NCCL and peer buffers set up, norm compiled)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    outs = [fn(*b) for b in bufs]
            torch.cuda.current_stream().wait_stream(stream)
            for b, r in bufs:
                b.copy_(x)
                r.copy_(residual)
            graph.replay()
            torch.cuda.synchronize()
            err = max((o.double() - ref).abs().max().item() for o in outs)
            assert err <= ref_tol, f"{name} rows={rows} in a CUDA graph: max error {err} > {ref_tol}"
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            row[name] = start.elapsed_time(end) * 1000 / (replays * calls)
            del graph
        if rank == 0:
            results[rows] = row
    parallel.destroy_tensor_parallel()


def _calls(peer, xs: list[torch.Tensor], residuals: list[torch.Tensor | None], weight: torch.Tensor) -> list:
    """Our all-reduce of each x: fused with add + RMSNorm where it has a residual, plain otherwise."""
    return [peer.add_rms_norm(x, r, weight, EPS)[0] if r is not None else peer(x) for x, r in zip(xs, residuals)]


def _stress(rank: int, world_size: int, peer, hidden: int, device: torch.device, calls: int = 120) -> None:
    """Our kernel over a sequence of random sizes, plain sums and fused add + RMSNorm mixed,
    segments eager and in CUDA graphs of odd lengths, each graph replayed twice; every result
    against the float64 reference."""
    import random

    rng = random.Random(7)  # the same sequence on every rank
    rows = [1, 2, 3, 17, 64, 255, 256, 511, 1024]
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(device, torch.bfloat16)
    # (elements, fused?): a plain sum may cut a row short; a fused call takes whole rows
    specs = [(r * hidden, True) if rng.random() < 0.4 else (r * hidden // rng.choice([1, 2, 64]), False)
             for r in (rng.choice(rows) for _ in range(calls))]
    i = 0
    while i < len(specs):
        segment = specs[i: i + rng.choice([1, 3, 5, 7])]
        xs = [_inputs(rank, n // hidden + 1, hidden, device).view(-1)[:n].view(-1, hidden) if fused
              else _inputs(rank, n // hidden + 1, hidden, device).view(-1)[:n].contiguous() for n, fused in segment]
        residuals = [_inputs(-1, x.shape[0], hidden, device) if fused else None for x, (_, fused) in zip(xs, segment)]
        expected = []
        for (n, fused), residual in zip(segment, residuals):
            total = sum(_inputs(r, n // hidden + 1, hidden, device).view(-1)[:n].double() for r in range(world_size))
            expected.append(_rms_norm(total.view(-1, hidden) + residual.double(), weight.double()) if fused else total)
        starts = [r.clone() if r is not None else None for r in residuals]

        if rng.random() < 0.5:
            outs = _calls(peer, xs, residuals, weight)
        else:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                outs = _calls(peer, xs, residuals, weight)
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            peer(xs[0].view(-1))  # an eager call between two replays
            for r, s in zip(residuals, starts):
                if r is not None:
                    r.copy_(s)  # the fused calls add into the residual: start the second replay afresh
            graph.replay()
        torch.cuda.synchronize()
        for out, exp, (_, fused) in zip(outs, expected, segment):
            tol = exp.abs().max().item() * (2**-5 if fused else 2**-7) + (1e-2 if fused else 1e-3)
            what = "norm" if fused else "sum"
            assert (out.double() - exp).abs().max().item() <= tol, f"stress call {i}: wrong {what}"
        i += len(segment)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world_size: int, rows_list: tuple[int, ...], hidden: int, calls: int = 20, replays: int = 20) -> dict:
    """Spawn `world_size` processes; returns rank 0's {rows: {method: microseconds per call}}."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(check_and_time, nprocs=world_size, join=True,
                 args=(world_size, f"tcp://127.0.0.1:{free_port()}", rows_list, hidden, calls, replays, results))
        return dict(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="*", default=list(DEFAULT_ROWS))
    args = ap.parse_args()
    results = run(args.world_size, tuple(args.rows), args.hidden)
    print(f"all-reduce of rows x {args.hidden} bf16 over {args.world_size} GPUs, us per call inside a CUDA graph")
    print("(ours + norm: our all-reduce, then residual add + RMSNorm compiled; fused norm: one kernel for both)")
    names = ("nccl", "torch one-shot", "ours", "ours + norm", "fused norm")
    print(f"{'rows':>6} {'MiB':>7} " + " ".join(f"{n:>15}" for n in names))
    for rows in sorted(results):
        cells = [f"{results[rows][n]:15.1f}" if results[rows].get(n) is not None else f"{'-':>15}" for n in names]
        print(f"{rows:6d} {rows * args.hidden * 2 / 2**20:7.2f} " + " ".join(cells))


if __name__ == "__main__":
    main()
