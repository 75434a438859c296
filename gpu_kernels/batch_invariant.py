"""Batch-invariant matmul and RMSNorm for the deterministic mode (issue 34): a row's result, bit for bit, does not
depend on how many rows share its batch, on what they hold, or on where in the batch it sits.

A GEMM library chooses its tiling, and with it each output's reduction order, from the shape: cuBLAS picks other
tiles and split-K counts as M grows, and CPU BLAS other kernels (fp32 `F.linear` on MKL gives row 0 other bits at
M = 1, 2..3 and >= 4). Thinking Machines ("Defeating Nondeterminism in LLM Inference", He et al., 2025) showed that
this, not atomics, is why a request's logits change with its neighbours, and that kernels with one reduction order
for every batch fix it; vLLM's `VLLM_BATCH_INVARIANT` and SGLang's deterministic mode build on their Triton kernels.

- `matmul_batch_invariant`: on a GPU a persistent Triton GEMM (`persistent_matmul`). K is cut into splits at a
  fixed feature count (never by M); each split is summed by one chain of `tl.dot` steps of a fixed depth, and the
  split sums are added in order, float32 throughout, rounded once to x's dtype. Those two numbers are fixed per
  dtype (`HOPPER_CONFIGS`); only the tile follows M. Element (m, n) is the same sequence of float32 operations
  whatever the tile's shape and other rows, and whether the splits ran in one program (large M) or side by side
  (small M, where the output tiles alone would leave most SMs idle); rows past M are never stored. On a CPU,
  `chunked_linear`: fixed chunks of `CPU_CHUNK_ROWS` rows, zero-padded, each one `F.linear` of the same shape, so
  BLAS makes the same choice for every chunk.
- `rms_norm_batch_invariant`: on a GPU one program per row with a block fixed by the hidden size
  (`rms_norm_rows`); on a CPU the formula of `workers/layers/norm.py` in chunks of `CPU_CHUNK_ROWS` rows
  (`chunked_rms_norm`): torch's CPU reduction splits one row over threads when the tensor is large and has few
  rows (from 65,536 features a row at 2 threads), and a fixed shape makes that decision the same for every batch.

Determinism here means: the same inputs and the same row give the same bits for any M on the same device, dtype,
torch and Triton versions and (CPU) thread count. The GPU and CPU paths do not give each other's bits.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common import envs
from gpu_kernels.gemv import silu_mul
from gpu_kernels.paged_attention import tile_dot
from gpu_kernels.pdl import launch_options, pdl_for
from gpu_kernels.rounding import round_to
from gpu_kernels.split_counters import split_counters

BATCH_INVARIANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Rows per CPU chunk. At M <= 16 a chunk reads the weight once, as M = 1 would, so a decode step pays for the
# padding only in multiply-adds; above it the weight is read once per chunk. One thread, K = 1024, N = 3072, fp32
# (Sapphire Rapids): 1.7 ms at M = 1 against 0.7 ms for F.linear, 114 ms at M = 1024 against 44 ms.
CPU_CHUNK_ROWS = 16
_DEFAULT_NUM_SMS = 132  # an H100/H200, where the device cannot be asked (CPU tensors, the interpreter)
_NORM_MAX_BLOCK = 1024  # features per RMSNorm loop iteration at most


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """The one launch configuration of `persistent_matmul` for a dtype; nothing in it may depend on M.

    block_m, block_n, block_k: output rows, output features and input features of a tile (powers of two >= 16).
    k_split: input features per split of K (a multiple of block_k): each split is summed from zero and the splits'
        sums added in order, whether one program adds them (large M) or several compute them side by side (small
        M, where the output tiles alone would leave most SMs idle).
    group_m: row tiles that take their turns on one column of weight tiles, so that column stays in L2.
    num_warps, num_stages: Triton's launch options.
    programs_per_sm: the persistent grid's programs per SM at most (capped at the work items). Several keep more
        weight loads in flight where each program has few tiles to stream (a decode step's few rows).
    """

    block_m: int
    block_n: int
    block_k: int
    k_split: int = 256
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of two >= 16, got {value}")
        if self.k_split < self.block_k or self.k_split % self.block_k:
            raise ValueError(f"MatmulConfig.k_split must be a multiple of block_k ({self.block_k}), got "
                             f"{self.k_split}")
        if self.group_m < 1:
            raise ValueError(f"MatmulConfig.group_m must be >= 1, got {self.group_m}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"MatmulConfig.num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"MatmulConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.programs_per_sm < 1:
            raise ValueError(f"MatmulConfig.programs_per_sm must be >= 1, got {self.programs_per_sm}")


# Hopper (H100/H200), for M from 1 to 8192 and N, K from hundreds to tens of thousands: a configuration per range
# of M (`hopper_config`). What fixes an element's arithmetic is shared by all of a dtype's configurations: the K
# step (block_k, a chain of tl.dot steps) and the split size (k_split). The tile's rows and columns, warps and
# stages are not part of it: on an H200 (2026-12-06, benchmarks/RESULTS.md) every tile from 16 x 64 with 4
# warps (mma.sync) to 128 x 256 with 8 warps (wgmma) gave the same bits as 128 x 128 on Qwen3-0.6B's shapes, as
# both instructions accumulate each output element alone in float32; tests/kernels/test_batch_invariant.py checks it
# on every GPU run (rows alone use the small tile, batches the large ones). So a decode step's few rows take a tile
# of 16 rows (the weight read dominates; the 128-row tile multiplied 127 copies of the row for nothing) and narrow
# columns for more programs; large M the 128 x 128 tile of two warpgroups near cuBLAS. K splits every 512 features:
# enough work items for the SMs at M = 1 on every Qwen3-0.6B layer, and a split boundary (where a program waits
# for its tensor cores to add a split's sum) only every 8 K steps at large M. The few-row tile streams its weight
# tiles 6 deep with up to 4 programs an SM: a whole forward's linear layers at M = 1 in a CUDA graph took 0.823 ms
# against 0.927 ms with 4 stages and one program an SM, the same bits (H100, `batch_invariant_bench.py
# --graph-sweep`, benchmarks/RESULTS.md 2026-12-07 night; 32-column tiles were slower, 1.06-1.55 ms). float32 (no
# tensor cores, IEEE products) halves the K step to keep the same shared memory.
def _hopper_family(block_k: int) -> tuple[tuple[int, MatmulConfig], ...]:
    """(largest M, configuration) pairs, in increasing M; the last one has no bound."""
    return (
        (16, MatmulConfig(block_m=16, block_n=64, block_k=block_k, k_split=512, num_warps=4, num_stages=6,
                          programs_per_sm=4)),
        (64, MatmulConfig(block_m=64, block_n=128, block_k=block_k, k_split=512, num_warps=4, num_stages=4)),
        (1 << 62, MatmulConfig(block_m=128, block_n=128, block_k=block_k, k_split=512, num_warps=8, num_stages=3)),
    )


HOPPER_CONFIGS = {
    torch.bfloat16: _hopper_family(64),
    torch.float16: _hopper_family(64),
    torch.float32: _hopper_family(32),
}


def with_small_tile(families: dict[torch.dtype, tuple[tuple[int, MatmulConfig], ...]], fields: dict[str, int]
                    ) -> dict[torch.dtype, tuple[tuple[int, MatmulConfig], ...]]:
    """Each dtype's few-row configuration (the first) with `fields` (tile and grid fields only:
    `common.envs.MATMUL_TILE_FIELDS`) replaced."""
    if not fields:
        return families
    return {dtype: ((family[0][0], dataclasses.replace(family[0][1], **fields)), *family[1:])
            for dtype, family in families.items()}


# DELTASERVE_MATMUL_SMALL_TILE (common/envs.py, read once): the few-row configuration's tile and grid on another GPU,
# say the winner of `benchmarks/batch_invariant_bench.py --graph-sweep`; a row's bits stay those of the default.
HOPPER_CONFIGS = with_small_tile(HOPPER_CONFIGS, envs.matmul_small_tile())


def hopper_config(dtype: torch.dtype, m: int) -> MatmulConfig:
    """The configuration of `HOPPER_CONFIGS[dtype]` for a batch of `m` rows."""
    for max_m, config in HOPPER_CONFIGS[dtype]:
        if m <= max_m:
            return config
    raise AssertionError("the last configuration has no bound")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# M changes from step to step: specializing on it (Triton compiles variants for 1, multiples of 16 and the rest)
# would compile mid-run. Specialization never changes the arithmetic, only how addresses are proven aligned.
@triton.jit(do_not_specialize=["M"])
def _persistent_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    # The K range is cut at every K_SPLIT features into splits; each split's products are summed from zero by one
    # chain of tl.dot steps over its K tiles, and the splits' sums are added to a float32 total in increasing
    # order. Program p takes work items p, p + P, p + 2P, ... (P programs, a few per SM at most). Without SPLIT_OUT
    # a work item is an output tile, all its splits in turn (the total kept in registers); with SPLIT_OUT it is one
    # split of one tile, whose sum goes to partial[split]; the program that stores a tile's last split to arrive
    # (gpu_kernels/split_counters.py) adds the tile's partials up in split order. Either way an output element is
    # the same sequence of float32 operations, whatever M is, whichever mode ran and whichever split came last.
    num_programs = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    num_splits = tl.cdiv(K, K_SPLIT)
    items = tiles_m * tiles_n * num_splits if SPLIT_OUT else tiles_m * tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    if PDL:  # gpu_kernels/pdl.py: the kernel before this one has finished and its memory is visible
        tl.extra.cuda.gdc_wait()
    for item in range(tl.program_id(0), items, num_programs):
        if SPLIT_OUT:
            tile = item // num_splits
            k_begin = (item % num_splits) * K_SPLIT
            k_end = tl.minimum(k_begin + K_SPLIT, K)
        else:
            tile = item
            k_begin = 0
            k_end = K
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % tiles_per_group) % group_size
        tile_n = (tile % tiles_per_group) // group_size
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past M and columns past N read the last row/column again (in bounds, no mask) and are never stored:
        # each output element sees only its own row of x and column of W.
        x_rows = tl.minimum(rows, M - 1).to(tl.int64)
        w_cols = tl.minimum(cols, N - 1).to(tl.int64)
        x_ptrs = x_ptr + x_rows[:, None] * stride_xm + (k_begin + offs_k)[None, :] * stride_xk
        w_ptrs = w_ptr + w_cols[None, :] * stride_wn + (k_begin + offs_k)[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_begin, k_end, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs)
            else:  # the last K tile adds products of zeros, which leave a float32 sum unchanged
                x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k, other=0.0)
                w = tl.load(w_ptrs, mask=offs_k[:, None] < K - k, other=0.0)
            if INTERPRETED:
                # numpy's matmul (the interpreter's tl.dot) gives a row other bits at another position in the tile
                # (OpenBLAS's micro-kernels split the rows); products summed over K by tl.sum, k after k, do not.
                acc += tile_dot(x, w, "rows")
            elif IEEE_DOT:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
            if not SPLIT_OUT:
                if ((k + BLOCK_K) % K_SPLIT == 0) | (k + BLOCK_K >= K):  # a split ends: its sum joins the total
                    total += acc
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        store_mask = (rows < M)[:, None] & (cols < N)[None, :]
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        if SPLIT_OUT:
            split = item % num_splits
            p_ptrs = partial_ptr + (split * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
            tl.store(p_ptrs, acc, mask=store_mask)
            # All of this program's partial is stored before its one thread's release of the tile's counter.
            tl.debug_barrier()
            if tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == num_splits - 1:
                # Every split's partial is visible (acquire); .cg reads them from L2, past this SM's L1.
                for s in range(0, num_splits):
                    p_ptrs = partial_ptr + (s * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
                    total += tl.load(p_ptrs, mask=store_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + w_cols).to(tl.float32)[None, :]
                tl.store(y_ptrs, round_to(total, y_ptr.dtype.element_ty), mask=store_mask)
                tl.store(counter_ptr + tile, 0)  # no other program of this launch touches it again
        else:
            if HAS_BIAS:
                total += tl.load(bias_ptr + w_cols).to(tl.float32)[None, :]
            tl.store(y_ptrs, round_to(total, y_ptr.dtype.element_ty), mask=store_mask)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _check_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"matmul_batch_invariant needs x [M, K] and weight [N, K], got x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} input features (K) but weight {tuple(weight.shape)} has "
                         f"{weight.shape[1]}")
    if x.dtype not in BATCH_INVARIANT_DTYPES:
        raise ValueError(f"x dtype {x.dtype} must be one of {BATCH_INVARIANT_DTYPES}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal x's dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias {bias.dtype} {tuple(bias.shape)} on {bias.device} must be {x.dtype} "
                         f"({weight.shape[0]},) on {x.device}")


def _without_k(m: int, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The product of K = 0: the bias in every row, or zeros."""
    n = weight.shape[0]
    if bias is None:
        return torch.zeros((m, n), dtype=dtype, device=weight.device)
    return bias.expand(m, n).clone()


def persistent_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      config: MatmulConfig | None = None, num_programs: int | None = None,
                      split_out: bool | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` by the persistent Triton kernel, on any device (CPU tensors: the Triton interpreter).

    Args:
        x: `[M, K]` bfloat16, float16 or float32, any strides.
        weight: `[N, K]` in x's dtype, any strides (`nn.Linear`'s row-major layout reads fastest).
        bias: `[N]` in x's dtype, or None.
        config: the launch configuration; None: `hopper_config(x.dtype, M)`. Row-invariance holds for any one
            config used for every M, and for configurations that differ only in their tile (block_m, block_n,
            group_m, num_warps, num_stages), as `HOPPER_CONFIGS`' do (see there).
        num_programs: programs of the persistent grid; None: `config.programs_per_sm` times the device's SM count
            (132 for CPU tensors), capped at the number of work items. It never changes the result.
        split_out: compute K's splits side by side, each program's split sum to a float32 workspace
            `[splits, M, N]` that the last of a tile's programs to finish adds up (True), or every split of a tile in
            one program (False). None: side by side where the output tiles are fewer than the programs and K has
            several splits. It never changes the result either: both add the same split sums in the same order.

    Returns:
        y `[M, N]` contiguous, in x's dtype: per split of `config.k_split` features, float32 sums over K tiles of
        `block_k` in increasing order (exact products of 16-bit inputs on tensor cores; IEEE float32 products for
        float32; under the interpreter float32 products summed k after k within a tile); the splits' sums added
        in order to 0, then the bias, in float32; one rounding to nearest even. Row m depends only on x[m],
        weight, bias and the config's block_k and k_split.

    Raises:
        ValueError: x or weight not 2-D, differing K, a dtype not in `BATCH_INVARIANT_DTYPES` or differing
            dtypes, tensors on different devices, a bias not `[N]` in x's dtype.

    Reads no tensor value on the host, so it can be captured in a CUDA graph once an eager call on the device has
    allocated the split counters (`gpu_kernels/split_counters.py`; the model runner's warm-up makes one).
    """
    _check_matmul(x, weight, bias)
    m, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    if m == 0 or n == 0 or k == 0:
        return _without_k(m, weight, bias, x.dtype)
    config = config or hopper_config(x.dtype, m)
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    splits = triton.cdiv(k, config.k_split)
    max_programs = num_programs or config.programs_per_sm * _num_sms(x.device)
    if split_out is None:
        split_out = splits > 1 and tiles < max_programs
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if split_out else y
    # None splits above max_programs tiles unless asked to; reserve that many counters on the first call.
    counters = split_counters(x.device, tiles, "batch-invariant matmul", max_programs) if split_out else y
    programs = min(tiles * (splits if split_out else 1), max_programs)
    pdl = pdl_for(x)
    _persistent_matmul_kernel[(programs,)](
        x, weight, bias if bias is not None else y, y, partial, counters, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, K_SPLIT=config.k_split,
        GROUP_M=config.group_m, HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0,
        # CPU tensors run in the interpreter, whose products are taken in float32 (exact for 16-bit inputs, as on
        # tensor cores) and summed without numpy's matmul.
        IEEE_DOT=x.dtype == torch.float32, INTERPRETED=x.device.type == "cpu", SPLIT_OUT=split_out, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    return y


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed `CPU_CHUNK_ROWS` rows at a time, for the CPU torch backend.

    Each chunk is copied into one zero-padded `[CPU_CHUNK_ROWS, K]` buffer (one allocation, so one alignment) and
    multiplied by one `F.linear` call, so every row of every batch goes through a BLAS call of one shape with the
    same operands' layout: BLAS picks its kernel by shape (and MKL may vary with alignment), never by the values.

    Args, errors: as `matmul_batch_invariant`. Returns y `[M, N]` contiguous in x's dtype (F.linear's accumulation:
    float32 for every dtype here).
    """
    _check_matmul(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0 or k == 0:
        return _without_k(m, weight, bias, x.dtype)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    chunk = torch.empty((CPU_CHUNK_ROWS, k), dtype=x.dtype, device=x.device)
    for start in range(0, m, CPU_CHUNK_ROWS):
        rows = min(CPU_CHUNK_ROWS, m - start)
        chunk[:rows].copy_(x[start:start + rows])
        chunk[rows:].zero_()
        y[start:start + rows].copy_(F.linear(chunk, weight, bias)[:rows])
    return y


def matmul_batch_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` whose every row is bitwise the same whatever the batch around it.

    CUDA tensors: `persistent_matmul` with `hopper_config(x.dtype, M)`; CPU tensors: `chunked_linear`. The two
    paths do not give each other's bits; each gives one row the same bits at every M, position and neighbours.

    Args:
        x: `[M, K]` (tokens x input features) bfloat16, float16 or float32; M may be 0.
        weight: `[N, K]` in x's dtype on x's device.
        bias: `[N]` in x's dtype, or None.

    Returns:
        y `[M, N]` in x's dtype: float32 accumulation, rounded once.

    Raises:
        ValueError: x or weight not 2-D, differing K, a dtype outside `BATCH_INVARIANT_DTYPES` or differing
            dtypes, tensors on different devices, a bias not `[N]` in x's dtype.

    Source: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025): one tiling for every batch
    size, a persistent grid; K is split here as they split the KV of decode attention, at a fixed size rather
    than a fixed count, so the split does not follow the batch and small batches still fill the SMs.
    """
    if x.is_cuda:
        return persistent_matmul(x, weight, bias)
    return chunked_linear(x, weight, bias)


@triton.jit
def _load_h(x_row, res_row, offs, H, dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """h = x (or round(x + residual) to x's dtype) at `offs` of one row; 0 past H."""
    h = tl.load(x_row + offs, mask=offs < H, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_row + offs, mask=offs < H, other=0.0)
        h = round_to(h.to(tl.float32) + r.to(tl.float32), dtype)
    return h


@triton.jit(do_not_specialize=["eps"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, H, stride_x, stride_res, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    # Program r normalises row r alone: one pass sums h^2 over the row in BLOCK-wide slices into a [BLOCK] float32
    # vector, reduced once by tl.sum's fixed tree; a second pass scales. h = round(x + residual) (or x) is computed
    # alike in both passes and written by the first; out and h are contiguous [rows, H].
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    if PDL:  # gpu_kernels/pdl.py
        tl.extra.cuda.gdc_wait()
    for start in range(0, H, BLOCK):
        offs = start + cols
        h = _load_h(x_row, res_row, offs, H, dtype, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_ptr + row * H + offs, h, mask=offs < H)
        h32 = h.to(tl.float32)
        squares += h32 * h32
    # H as a float32 tensor: tl.full also takes the constant Triton makes of an argument equal to 1.
    inv_rms = tl.rsqrt(tl.div_rn(tl.sum(squares, axis=0), tl.full((), H, tl.float32)) + eps)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    for start in range(0, H, BLOCK):
        offs = start + cols
        h = _load_h(x_row, res_row, offs, H, dtype, HAS_RESIDUAL)
        w = tl.load(w_ptr + offs, mask=offs < H, other=0.0).to(tl.float32)
        # weight * round(h * inv_rms), rounded: workers/layers/norm.py's two roundings to the model dtype.
        normed = round_to(h.to(tl.float32) * inv_rms, dtype).to(tl.float32)
        tl.store(out_ptr + row * H + offs, round_to(w * normed, dtype), mask=offs < H)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, features, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program (row, block): out[row, offs] = silu(gate) * up for the BLOCK features at offs; x's row is [gate | up],
    # each `features` wide.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < features
    if PDL:  # gpu_kernels/pdl.py
        tl.extra.cuda.gdc_wait()
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + features + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * features + offs, silu_mul(g, u, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_rows(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate, `silu(gate) * up` of x = `[gate | up]`, by one Triton kernel (`gemv.silu_mul`'s roundings).

    Element-wise, so each row's bits are its own at any batch size; one launch where eager torch takes two (the
    deterministic mode runs without torch.compile), and it takes part in PDL (gpu_kernels/pdl.py).

    Args:
        x: `[..., 2 * I]` bfloat16, float16 or float32, on a CUDA device (CPU tensors: the Triton interpreter).

    Returns:
        `[..., I]` contiguous, in x's dtype.

    Raises:
        ValueError: an odd last dimension or a dtype not in `BATCH_INVARIANT_DTYPES`.
    """
    if x.shape[-1] % 2 or x.dtype not in BATCH_INVARIANT_DTYPES:
        raise ValueError(f"silu_and_mul_rows needs x [..., 2 * I] in {BATCH_INVARIANT_DTYPES}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    features = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], features), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and features > 0:
        block = min(1024, triton.next_power_of_2(features))
        pdl = pdl_for(x)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(features, block))](
            x2, out, features, x2.stride(0), BLOCK=block, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out


def _check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm_batch_invariant needs x [..., hidden] with hidden >= 1, got {tuple(x.shape)}")
    if x.dtype not in BATCH_INVARIANT_DTYPES:
        raise ValueError(f"x dtype {x.dtype} must be one of {BATCH_INVARIANT_DTYPES}")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)} on {weight.device} must be {x.dtype} "
                         f"({x.shape[-1]},) on {x.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} on {residual.device} must be "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t `[..., H]` as `[rows, H]` with stride 1 along H (a view where the layout allows)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 else t.contiguous()


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                  block: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of every row by the one-program-per-row Triton kernel, on any device (CPU: the interpreter).

    Args, returns, errors: as `rms_norm_batch_invariant`. `block`: features per loop iteration (a power of two;
    None: the hidden size's next power of two, at most 1024). It depends on the hidden size only, never on the
    number of rows.
    """
    _check_rms_norm(x, weight, residual)
    hidden = x.shape[-1]
    block = block or min(_NORM_MAX_BLOCK, triton.next_power_of_2(hidden))
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if x2.shape[0] > 0:
        pdl = pdl_for(x)
        _rms_norm_kernel[(x2.shape[0],)](x2, res2, weight.contiguous(), out, h, hidden, x2.stride(0),
                                         res2.stride(0), eps, BLOCK=block, HAS_RESIDUAL=residual is not None,
                                         PDL=pdl, num_warps=4, **launch_options(pdl))
    return (out, h) if residual is not None else out


def _rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # workers/layers/norm.py's rms_norm, operation for operation (gpu_kernels does not import workers).
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def chunked_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with torch ops on `CPU_CHUNK_ROWS` rows at a time, for the CPU torch backend.

    `workers/layers/norm.py`'s formula on one zero-padded `[CPU_CHUNK_ROWS, hidden]` buffer per chunk: torch's CPU
    reduction decides by the tensor's shape (and thread count) whether to split a row over threads, so a fixed
    shape sums every row of every batch in one order. The residual add is element-wise and needs no chunks.

    Args, returns, errors: as `rms_norm_batch_invariant`.
    """
    _check_rms_norm(x, weight, residual)
    h = x + residual if residual is not None else x
    h2 = h.reshape(-1, h.shape[-1])
    out = torch.empty(h2.shape, dtype=x.dtype, device=x.device)
    chunk = torch.empty((CPU_CHUNK_ROWS, h2.shape[1]), dtype=x.dtype, device=x.device)
    for start in range(0, h2.shape[0], CPU_CHUNK_ROWS):
        rows = min(CPU_CHUNK_ROWS, h2.shape[0] - start)
        chunk[:rows].copy_(h2[start:start + rows])
        chunk[rows:].zero_()
        out[start:start + rows] = _rms_norm_formula(chunk, weight, eps)[:rows]
    out = out.reshape(x.shape)
    return (out, h) if residual is not None else out


def rms_norm_batch_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                             residual: torch.Tensor | None = None
                             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) whose every row is bitwise the same whatever the batch around it.

    The semantics of `workers/layers/norm.py`: without a residual `rms_norm(x, weight, eps)`; with one
    `add_rms_norm`: h = x + residual rounded to x's dtype, and (normed h, h) returned. In float32,
    inv_rms = rsqrt(mean(h^2) + eps); normed = weight * round(h * inv_rms), rounded to x's dtype.

    CUDA tensors: `rms_norm_rows` (one Triton program per row); CPU tensors: `chunked_rms_norm`. The two paths do
    not give each other's bits; on a CPU at realistic hidden sizes the chunked path gives norm.py's own.

    Args:
        x: `[..., hidden]` (tokens x features, or tokens x heads x head_dim for QK-norm) bfloat16, float16 or
            float32; hidden >= 1, any number of rows (0 too).
        weight: `[hidden]` in x's dtype. eps: added to the mean square.
        residual: x's shape and dtype, or None. Neither input is written.

    Returns:
        normed, x's shape and dtype; with a residual, (normed, h), h a new tensor.

    Raises:
        ValueError: x 0-d or with hidden 0, a dtype outside `BATCH_INVARIANT_DTYPES`, a weight not `[hidden]` in
            x's dtype, a residual of another shape or dtype, tensors on different devices.
    """
    if x.is_cuda:
        return rms_norm_rows(x, weight, eps, residual)
    return chunked_rms_norm(x, weight, eps, residual)
