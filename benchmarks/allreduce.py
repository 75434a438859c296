"""All-reduce on N GPUs of one host: NCCL, PyTorch symmetric memory's one-shot kernel, and ours
(kernels/all_reduce.py, what workers/parallel.py uses), per call, inside CUDA graphs as a decode
step runs them.

For each size (rows x hidden in bf16) every rank sums random tensors of a known seed with each
method; each result is checked against the float64 sum, then a CUDA graph of `--calls`
back-to-back all-reduces is replayed `--replays` times and the mean time per all-reduce printed.
Before that, our kernel runs a stress sequence: calls of random sizes, some eager and some in CUDA
graphs of odd lengths, replayed in between, every result checked (its buffers are reused by epoch
parity across all of these).

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

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def torch_one_shot(x: torch.Tensor) -> torch.Tensor:
        staging = torch_buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", group_name)

    methods = {"nccl": nccl, "torch one-shot": torch_one_shot, "ours": peer}
    for rows in rows_list:
        x = _inputs(rank, rows, hidden, device)
        expected = sum(_inputs(r, rows, hidden, device).double() for r in range(world_size))
        tol = expected.abs().max().item() * 2**-7 + 1e-3  # one bf16 rounding of the result, plus slack
        row = {}
        for name, fn in methods.items():
            if name != "nccl" and x.numel() * x.element_size() > peer.max_bytes:
                row[name] = None
                continue
            got = fn(x.clone())
            err = (got.double() - expected).abs().max().item()
            assert err <= tol, f"{name} rows={rows}: max error {err} > {tol}"
            bufs = [x.clone() for _ in range(calls)]
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for b in bufs[:2]:
                    fn(b)  # warm up outside the graph (NCCL and peer buffers set up)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    outs = [fn(b) for b in bufs]
            torch.cuda.current_stream().wait_stream(stream)
            for b in bufs:
                b.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            err = max((o.double() - expected).abs().max().item() for o in outs)
            assert err <= tol, f"{name} rows={rows} in a CUDA graph: max error {err} > {tol}"
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


def _stress(rank: int, world_size: int, peer, hidden: int, device: torch.device, calls: int = 120) -> None:
    """Our kernel over a sequence of random sizes, segments eager and in CUDA graphs of odd lengths,
    each graph replayed twice; every result against the float64 sum."""
    import random

    rng = random.Random(7)  # the same sequence on every rank
    rows = [1, 2, 3, 17, 64, 255, 256, 511, 1024]
    sizes = [rng.choice(rows) * hidden // rng.choice([1, 2, 64]) for _ in range(calls)]
    i = 0
    while i < len(sizes):
        segment = sizes[i: i + rng.choice([1, 3, 5, 7])]
        xs = [_inputs(rank, n // hidden + 1, hidden, device).view(-1)[:n].contiguous() for n in segment]
        expected = [sum(_inputs(r, n // hidden + 1, hidden, device).view(-1)[:n].double() for r in range(world_size))
                    for n in segment]
        if rng.random() < 0.5:
            outs = [peer(x) for x in xs]
        else:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                outs = [peer(x) for x in xs]
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            peer(xs[0])  # an eager call between two replays
            graph.replay()
        torch.cuda.synchronize()
        for out, exp in zip(outs, expected):
            tol = exp.abs().max().item() * 2**-7 + 1e-3
            assert (out.double() - exp).abs().max().item() <= tol, f"stress call {i}: wrong sum"
        i += len(segment)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world_size: int, rows_list: tuple[int, ...], hidden: int, calls: int = 20, replays: int = 20) -> dict:
    """Spawn `world_size` processes; returns rank 0's {rows: {method: microseconds per all-reduce}}."""
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
    names = ("nccl", "torch one-shot", "ours")
    print(f"{'rows':>6} {'MiB':>7} " + " ".join(f"{n:>15}" for n in names))
    for rows in sorted(results):
        cells = [f"{results[rows][n]:15.1f}" if results[rows].get(n) is not None else f"{'-':>15}" for n in names]
        print(f"{rows:6d} {rows * args.hidden * 2 / 2**20:7.2f} " + " ".join(cells))


if __name__ == "__main__":
    main()
