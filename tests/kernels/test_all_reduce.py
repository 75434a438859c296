"""The one-shot peer-memory all-reduce kernel (gpu_kernels/all_reduce.py).

On CPU the ranks are processes under the Triton interpreter that share their "symmetric" buffers
through shared memory, so the kernel's pushes, epoch flags, double buffering and rank-order sum
run for real, only slower. On GPUs (`-m gpu`, two devices) the same kernel runs through
workers/parallel.py, eagerly and in CUDA graphs (tests/test_gpu_tp.py)."""

from __future__ import annotations

import os
import time
from queue import Empty

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("triton")
from gpu_kernels import all_reduce as ar  # noqa: E402

MAX_BYTES = 4 << 20
# Calls of mixed sizes: one element, partial chunks, and more chunks than programs (several per
# program); `(rows, hidden)` calls sum, add the residual and RMS-normalise (hidden not a power of
# two; more rows than programs), interleaved with the plain sums on the same buffers.
CALLS = (1, 5, (3, 96), 2048, 3000, (ar.GRID + 5, 40), 1, ar.GRID * ar.BLOCK + 77, (1, 1024), 16, 4096)
EPS = 1e-6


def _x(call: int, rank: int, shape: int | tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(100 * call + rank)) * 4).to(dtype)


def _residual_and_weight(call: int, shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + call)  # the same on every rank: the residual stream is replicated
    return torch.randn(shape, generator=g).to(dtype), (torch.rand(shape[1], generator=g) + 0.5).to(dtype)


def _rank(rank: int, world: int, buffers: list[torch.Tensor], dtype: torch.dtype, queue) -> None:
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)  # as mapped in this process
    epochs = torch.zeros(ar.GRID, dtype=torch.int64)
    outs = []
    for call, shape in enumerate(CALLS):
        x = _x(call, rank, shape, dtype)
        if isinstance(shape, tuple):
            residual, weight = _residual_and_weight(call, shape, dtype)
            out, residual = ar.one_shot_all_reduce_add_rms_norm(x, residual, weight, EPS, torch.empty_like(x),
                                                                buffers[rank], bases, epochs, rank, world, MAX_BYTES)
            outs.append((out.float().numpy(), residual.float().numpy()))
        else:
            out = ar.one_shot_all_reduce(x, torch.empty_like(x), buffers[rank], bases, epochs, rank, world, MAX_BYTES)
            outs.append(out.float().numpy())  # plain arrays: tensors in a queue would need this process alive
    queue.put((rank, outs, epochs.tolist()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU emulation of ranks; GPUs run tests/test_gpu_tp.py")
# Three float32 ranks (an odd count, a rank that is neither first nor last) and two bfloat16 ones: two float32 ranks
# add nothing these do not cover, and each case is half a minute under the interpreter on two cores.
@pytest.mark.parametrize(("world", "dtype"), [(3, torch.float32), (2, torch.bfloat16)])
def test_ranks_get_the_rank_order_sum_of_every_call(world: int, dtype: torch.dtype) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    buffers = [torch.zeros(ar.buffer_bytes(world, MAX_BYTES), dtype=torch.uint8).share_memory_() for _ in range(world)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, buffers, dtype, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = {}
        deadline = time.monotonic() + 300
        while len(results) < world:  # a rank that fails leaves the others spinning: stop at its exit
            try:
                r, outs, epochs = queue.get(timeout=1)
                results[r] = (outs, epochs)
            except Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead and time.monotonic() < deadline, f"a rank failed (exit codes {dead})"
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
    for call, shape in enumerate(CALLS):
        expected = _x(call, 0, shape, dtype).float()
        for r in range(1, world):
            expected = expected + _x(call, r, shape, dtype).float()  # float32, in rank order, like the kernel
        if isinstance(shape, tuple):
            residual, weight = _residual_and_weight(call, shape, dtype)
            new_residual = expected + residual.float()
            normed = new_residual * torch.rsqrt(new_residual.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
            # float32: the roundings to the dtype are exact. bf16: the sum (|x| < 32) and the residual add
            # are rounded (toward zero by the interpreter), a bf16 step of 1/8 each at most.
            exact = dtype == torch.float32
            for r in range(world):
                got_out, got_residual = (torch.from_numpy(a) for a in results[r][0][call])
                assert torch.allclose(got_residual, new_residual, rtol=0, atol=0 if exact else 0.25), (call, r)
                assert torch.allclose(got_out, normed, rtol=1e-5 if exact else 2**-6,
                                      atol=1e-6 if exact else 0.1), (call, r)
                assert all((a == b).all() for a, b in zip(results[r][0][call], results[0][0][call]))
            continue
        for r in range(world):
            got = torch.from_numpy(results[r][0][call])
            if dtype == torch.float32:
                assert torch.equal(got, expected), (call, r)
            else:  # the interpreter rounds float32 -> bf16 toward zero, a GPU to nearest: one bf16 step apart at most
                assert torch.allclose(got, expected, rtol=2**-7, atol=0), (call, r)
            assert torch.equal(got, torch.from_numpy(results[0][0][call]))  # bit-identical on every rank
    assert all(results[r][1] == [len(CALLS)] * ar.GRID for r in range(world))


def test_too_large_or_strided_tensors_are_refused() -> None:
    bases, epochs = torch.zeros(2, dtype=torch.int64), torch.zeros(ar.GRID, dtype=torch.int64)
    buffer = torch.zeros(ar.buffer_bytes(2, MAX_BYTES), dtype=torch.uint8)
    big = torch.zeros(MAX_BYTES // 4 + 1)
    with pytest.raises(ValueError, match="at most"):
        ar.one_shot_all_reduce(big, torch.empty_like(big), buffer, bases, epochs, 0, 2, MAX_BYTES)
    strided = torch.zeros(8, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        ar.one_shot_all_reduce(strided, torch.empty(8, 8), buffer, bases, epochs, 0, 2, MAX_BYTES)
    with pytest.raises(ValueError, match="world_size"):
        ar.one_shot_all_reduce(torch.zeros(4), torch.zeros(4), buffer, bases, epochs, 0, 1, MAX_BYTES)
