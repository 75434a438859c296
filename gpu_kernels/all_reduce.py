"""One-shot all-reduce over peer-mapped GPU memory, for the small activations of tensor parallelism.

Every rank holds a buffer that all ranks have mapped (PyTorch symmetric memory: NVLink peer
access, no multicast). A call sums `x` over the ranks in one kernel of `GRID` programs, and
program `p` only ever meets program `p` of the other ranks:

1. push: program p stores its chunks of `x` straight into every peer's buffer (slot `rank`);
   remote stores are posted, so the data crosses NVLink at link speed;
2. signal: after a CTA barrier, one release store at system scope of the call's epoch into flag
   `[rank, p]` of every peer says "my chunks are there";
3. wait: the program spins (acquire, system scope) until every peer's flag `[peer, p]` of its own
   buffer reaches the epoch;
4. sum: it reads the peers' chunks from its own memory and adds them to its own `x` in rank
   order, in float32, so every rank computes bit-identical sums (the replicated residual stream
   must not drift apart between ranks).

No grid-wide barrier and no second kernel. Buffers are reused safely by double-buffering on the
epoch's parity: a program writes a peer's area of parity e % 2 only after it has seen that peer's
flag for epoch e - 1, which the peer raised in a later kernel than the one whose programs all
read epoch e - 2's data from that area (kernels on one stream run in order). This holds across
CUDA-graph replays and eager calls alike because each program keeps its epoch in device memory,
every rank makes the same calls with the same shapes (as with any collective), and a process
uses one dtype. Within a call, program p owns chunks p, p + GRID, ... on every rank.

`one_shot_all_reduce_add_rms_norm` is the same kernel with chunks of one row each and an epilogue:
the summed row is added to the residual stream and RMS-normalised in place of the separate
residual-add + RMSNorm kernel that follows every row-parallel layer (two a decoder layer), which
saves a kernel launch and two passes over the activations per all-reduce.

All `GRID` programs spin while they wait, so they must all be resident at once: a program is 256
threads with few registers, so even two programs an SM fit with room to spare; `PeerAllReduce`
refuses devices with fewer than GRID / 2 SMs.

The scheme is the classic flag-based one-shot all-reduce of inference engines (for example
vLLM's and TensorRT-LLM's custom all-reduce kernels), written here in Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GRID = 128  # programs per call; each handles chunks p, p + GRID, p + 2 GRID, ...
BLOCK = 4096  # elements per chunk: a 2 MiB bf16 tensor is two rounds of the grid
FLAG_BYTES = 4096  # head of each rank's buffer: int64 flags [world_size, GRID]
MAX_WORLD_SIZE = 8
MAX_NORM_HIDDEN = 8192  # the fused RMSNorm holds a whole row in one program


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr,
    out_ptr,
    numel,
    row_numel,  # elements per chunk: BLOCK_SIZE for a plain sum, the hidden size with FUSE_NORM
    area_ptr,  # this rank's data area (its buffer past the flags), typed like x
    flags_ptr,  # this rank's flags, int64 [world_size, GRID]
    bases_ptr,  # int64 [world_size]: address of every rank's buffer, as mapped in this process
    epochs_ptr,  # int64 [GRID]: calls made so far by each program (this rank's, in device memory)
    rank,
    slot_numel,  # elements of one (parity, rank) slot
    residual_ptr,  # FUSE_NORM only: [rows, row_numel], read, then overwritten with sum + residual
    weight_ptr,  # FUSE_NORM only: RMSNorm weight [row_numel]
    eps,
    WORLD: tl.constexpr,
    ELEMENT_BYTES: tl.constexpr,
    GRID_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FUSE_NORM: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = tl.load(epochs_ptr + pid) + 1
    parity = epoch % 2
    my_base = tl.load(bases_ptr + rank)
    lanes = tl.arange(0, BLOCK_SIZE)
    in_row = lanes < row_numel
    num_rows = tl.cdiv(numel, row_numel)

    # 1. push this program's chunks (rows p, p + GRID, ...) into slot `rank` of every peer's area
    # `parity`. A peer's area is ours shifted by the distance between the buffers; buffers are
    # page-aligned, and saying so lets the compiler move 16-byte vectors.
    for row in range(pid, num_rows, GRID_SIZE):
        offs = row * row_numel + lanes
        mask = in_row & (offs < numel)
        v = tl.load(x_ptr + offs, mask=mask)
        for r in tl.static_range(WORLD):
            if r != rank:
                shift = tl.multiple_of((tl.load(bases_ptr + r) - my_base) // ELEMENT_BYTES, 16)
                tl.store(area_ptr + shift + (parity * WORLD + rank) * slot_numel + offs, v, mask=mask)
    tl.debug_barrier()
    # 2. signal: the release orders every thread's pushes (made visible to this one by the barrier).
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = flags_ptr + (tl.load(bases_ptr + r) - my_base) // 8
            tl.atomic_xchg(peer_flags + rank * GRID_SIZE + pid, epoch, sem="release", scope="sys")
    # 3. wait for program `pid` of every peer. A peer may already be one call ahead (>=, not ==).
    never = tl.full([], -1, tl.int64)  # a compare-and-swap that never matches (flags are >= 0): an acquire load
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_cas(flags_ptr + r * GRID_SIZE + pid, never, never, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_cas(flags_ptr + r * GRID_SIZE + pid, never, never, sem="acquire", scope="sys")
    tl.debug_barrier()
    # 4. sum in rank order from local memory (.cg: straight from L2, where the peers' stores land).
    for row in range(pid, num_rows, GRID_SIZE):
        offs = row * row_numel + lanes
        mask = in_row & (offs < numel)
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == rank:
                acc += tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            else:
                acc += tl.load(area_ptr + (parity * WORLD + r) * slot_numel + offs, mask=mask,
                               cache_modifier=".cg").to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        if FUSE_NORM:
            # The unfused layers' numbers: sum rounded to the model dtype, residual add rounded,
            # RMSNorm in float32, rounded, then scaled by the weight.
            s = (acc.to(dtype).to(tl.float32) + tl.load(residual_ptr + offs, mask=mask).to(tl.float32)).to(dtype)
            tl.store(residual_ptr + offs, s, mask=mask)
            s32 = s.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(s32 * s32, axis=0) / row_numel + eps)
            w = tl.load(weight_ptr + lanes, mask=in_row).to(tl.float32)
            tl.store(out_ptr + offs, (w * (s32 * inv_rms).to(dtype).to(tl.float32)).to(dtype), mask=mask)
        else:
            tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    tl.store(epochs_ptr + pid, epoch)


def buffer_bytes(world_size: int, max_bytes: int) -> int:
    """Bytes of the symmetric buffer each rank allocates for tensors of up to `max_bytes`."""
    return FLAG_BYTES + 2 * world_size * max_bytes


def _check(x: torch.Tensor, out: torch.Tensor, world_size: int, max_bytes: int, what: str) -> None:
    nbytes = x.numel() * x.element_size()
    if nbytes > max_bytes or not x.is_contiguous() or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError(f"{what} takes contiguous tensors of at most {max_bytes} bytes, "
                         f"got {tuple(x.shape)} {x.dtype} ({nbytes} bytes)")
    if not 2 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be 2..{MAX_WORLD_SIZE}, got {world_size}")


def _launch(x: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor, bases: torch.Tensor, epochs: torch.Tensor,
            rank: int, world_size: int, max_bytes: int, row_numel: int, block: int,
            residual: torch.Tensor | None = None, weight: torch.Tensor | None = None, eps: float = 0.0) -> None:
    area = buffer[FLAG_BYTES:].view(x.dtype)
    flags = buffer[:FLAG_BYTES].view(torch.int64)
    fuse = residual is not None
    _one_shot_all_reduce_kernel[(GRID,)](
        x, out, x.numel(), row_numel, area, flags, bases, epochs, rank, max_bytes // x.element_size(),
        residual if fuse else x, weight if fuse else x, eps,
        WORLD=world_size, ELEMENT_BYTES=x.element_size(), GRID_SIZE=GRID, BLOCK_SIZE=block, FUSE_NORM=fuse,
        num_warps=8,
    )


def one_shot_all_reduce(x: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor, bases: torch.Tensor,
                        epochs: torch.Tensor, rank: int, world_size: int, max_bytes: int) -> torch.Tensor:
    """`out` = the sum of `x` over all ranks (every rank calls this with the same shape and dtype).

    Args:
        x: contiguous CUDA tensor, at most `max_bytes`, in the process's one all-reduce dtype.
        out: contiguous tensor like `x` (may not alias it).
        buffer: this rank's symmetric buffer, uint8 `[buffer_bytes(world_size, max_bytes)]`,
            zeroed before first use, at an address that is a multiple of 16.
        bases: `[world_size]` int64 on the device: the address of each rank's buffer as mapped in
            this process (`bases[rank] == buffer.data_ptr()`).
        epochs: `[GRID]` int64 on the device, zeroed once, then owned by this module's functions.
        rank, world_size: this rank and the group size (<= MAX_WORLD_SIZE).

    Returns `out`. Capturable in a CUDA graph. Raises ValueError on a tensor too large, or not
    contiguous.
    """
    _check(x, out, world_size, max_bytes, "one_shot_all_reduce")
    _launch(x, out, buffer, bases, epochs, rank, world_size, max_bytes, BLOCK, BLOCK)
    return out


def one_shot_all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
    buffer: torch.Tensor, bases: torch.Tensor, epochs: torch.Tensor, rank: int, world_size: int, max_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of `x` over all ranks, added to `residual`, then RMSNorm: the tail of a tensor-parallel
    attention or MLP block and the norm of the next, in one kernel.

    With s = round(round(sum over ranks of x) + residual), sets `residual` to s and `out` to
    round(weight * round(s / sqrt(mean(s^2) + eps))) (rounding to x's dtype, arithmetic in float32):
    what `all_reduce` followed by `RMSNorm(x, residual)` gives.

    Args:
        x: `[rows, hidden]` contiguous, at most `max_bytes`, in the process's one all-reduce dtype.
        residual: like `x`; overwritten in place with the new residual stream.
        weight: `[hidden]` RMSNorm weight; eps: its epsilon.
        out: like `x`, aliasing neither `x` nor `residual`.
        The rest as for `one_shot_all_reduce` (the same buffer, bases and epochs serve both).

    Returns (out, residual). Capturable in a CUDA graph. Raises ValueError on tensors too large, not
    contiguous or of mismatched shapes, or hidden > MAX_NORM_HIDDEN.
    """
    _check(x, out, world_size, max_bytes, "one_shot_all_reduce_add_rms_norm")
    hidden = x.shape[-1]
    if residual.shape != x.shape or not residual.is_contiguous() or weight.shape != (hidden,):
        raise ValueError(f"residual must be contiguous {tuple(x.shape)} and weight [{hidden}], "
                         f"got {tuple(residual.shape)} and {tuple(weight.shape)}")
    if hidden > MAX_NORM_HIDDEN:
        raise ValueError(f"hidden size {hidden} is over {MAX_NORM_HIDDEN}, the most one program normalises")
    _launch(x, out, buffer, bases, epochs, rank, world_size, max_bytes, hidden, triton.next_power_of_2(hidden),
            residual, weight, eps)
    return out, residual
