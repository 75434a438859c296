"""All-reduce on N GPUs of one host: NCCL against the one-shot peer-memory all-reduce
(workers/parallel.py), per call, inside CUDA graphs as a decode step runs them.

For each size (rows x hidden in bf16) every rank sums random tensors of a known seed with both
methods; each result is checked against the float64 sum, then a CUDA graph of `--calls`
back-to-back all-reduces is replayed `--replays` times and the mean time per all-reduce printed.

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

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    methods = {"nccl": nccl, "peer one-shot": peer}
    for rows in rows_list:
        x = _inputs(rank, rows, hidden, device)
        expected = sum(_inputs(r, rows, hidden, device).double() for r in range(world_size))
        tol = expected.abs().max().item() * 2**-7 + 1e-3  # one bf16 rounding of the result, plus slack
        row = {}
        for name, fn in methods.items():
            if name != "nccl" and not peer.accepts(x):
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
    print(f"{'rows':>6} {'MiB':>7} {'nccl':>8} {'peer one-shot':>14}")
    for rows in sorted(results):
        r = results[rows]
        peer = f"{r['peer one-shot']:14.1f}" if r.get("peer one-shot") is not None else f"{'-':>14}"
        print(f"{rows:6d} {rows * args.hidden * 2 / 2**20:7.2f} {r['nccl']:8.1f} {peer}")


if __name__ == "__main__":
    main()
