"""`y = x @ W.T + bias` for a small batch (decode): a matrix-vector product that reads W at memory bandwidth.

At decode a linear layer multiplies a few rows of activations (`M`, the batch: 1..16) by a weight of
megabytes, so its time is the time to read W once. A GEMM library's tiles are shaped for large M; at M = 1
cuBLAS reads a 1024 x 4096 bf16 weight at 0.68 TB/s of the H200's 4.25. This kernel spreads W over enough
programs that every SM keeps loads in flight:

- Program (n, s, m) owns `BLOCK_N` output features (rows of W) and one of `split_k` equal slices of the
  K dimension, and streams its `[BLOCK_N, BLOCK_K]` tiles of W once; `BLOCK_K`-wide tiles of x are small and
  stay in cache. Split-K is used where N alone gives too few programs (N = 1024 at K = 3072, say).
- One batch row per program (`use_dot=False`): each tile is multiplied element-wise in float32 and summed along
  K into a `[BLOCK_N]` accumulator (96 registers a thread at the default tile when compiled for sm90; a
  `[BLOCK_N, BLOCK_K]` accumulator summed once at the end took 154, so fewer programs fit on an SM).
  Otherwise (`use_dot=True`) the batch is padded to 16 rows and each tile goes through `tl.dot(W, x.T)`, W as
  the left operand ("swap AB": its BLOCK_N rows fill the tensor-core tile's long side; sm90 compiles it to
  wgmma fed by a 3-stage cp.async pipeline), so the multiply costs nothing next to the load at any M up to 16.
- With one split the program adds the bias, rounds to x's dtype and writes y. With several, each writes its
  float32 partial sums to a `[split_k, M, N]` buffer and a second kernel adds them in split order, then the
  bias: no atomics, so the same inputs give the same bits on every run.

The launch configuration comes from the shapes alone (`choose_gemv_config`, documented there), never from
timing runs, and no tensor value is read on the host: a call can be captured in a CUDA graph. Accumulation is
float32 throughout; the result is rounded once, to nearest even.

The design follows the split-K GEMV kernels of the Triton community for decode (e.g. PyTorch's
"Accelerating a Triton fused kernel for W4A16 quantized inference with SplitK work decomposition", Hoque,
Wright et al. 2024), with a deterministic reduction in place of their atomic adds.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to

GEMV_DTYPES = (torch.bfloat16, torch.float16)

# The heuristic's knobs (see `choose_gemv_config`).
_TARGET_PROGRAMS_PER_SM = 4  # programs wanted per SM: enough resident loads to hide DRAM latency
_DEFAULT_NUM_SMS = 132  # an H100/H200, where the device cannot be asked (CPU, the interpreter)
# Batches up to this take the element-wise path, larger ones tensor cores (0: tensor cores always; benchmarks/gemv.py
# times both at M = 1).
_ELEMENTWISE_MAX_M = 1
_TILE_ELEMENTS = 8192  # elements of W per program per loop iteration: 16 KiB of bf16
_DOT_BLOCK_N = 64  # W rows per program on the tensor-core path (a wgmma tile's 64 rows)
_DOT_BLOCK_M = 16  # batch rows per program on the tensor-core path: tl.dot's smallest dimension
_FMA_BLOCK_N = 32  # W rows per program on the element-wise path
# The float32 partials of a split cost 4 bytes per (split, row, feature) written and read: keep them below
# 1/8 of the weight bytes (2 per feature and input), i.e. split_k * M * 4 <= K * 2 / 8.
_PARTIAL_BYTES_DIVISOR = 8
_REDUCE_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of `gemv`.

    block_n: W rows (output features) per program, a power of two >= 16.
    block_k: input features per loop iteration, a power of two >= 16.
    split_k: slices of K computed by separate programs and summed afterwards (>= 1; the kernel uses
        `ceil(K / k_per_split)` of them, `k_per_split` a multiple of block_k, so it may run fewer).
    use_dot: the batch goes through `tl.dot` in tiles of 16 rows; otherwise one row per program, element-wise.
    num_warps, num_stages: Triton's launch options.
    """

    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= 16, got {value}")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k must be >= 1, got {self.split_k}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"GemvConfig.num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")


def _pow2_at_most(n: int, limit: int) -> int:
    """The smallest power of two >= n, capped at `limit`, and at least 16."""
    return max(16, min(limit, triton.next_power_of_2(max(n, 1))))


def choose_gemv_config(m: int, n: int, k: int, num_sms: int = _DEFAULT_NUM_SMS) -> GemvConfig:
    """The launch configuration for x `[m, k]` times W `[n, k]`, from the shapes alone.

    1. Path: element-wise for m <= `_ELEMENTWISE_MAX_M` (1: one multiply-add per weight element, no padding),
       tensor cores (`tl.dot`, the batch padded to 16 rows) above, where m multiply-adds per weight element
       would otherwise compete with the loads for the SM's issue slots.
    2. Tile: `_TILE_ELEMENTS` (8192, 16 KiB of bf16) weight elements per program and iteration:
       block_n = 64 rows x block_k = 128 on the tensor-core path, 32 x 256 element-wise; smaller where n or k
       is smaller (powers of two >= 16).
    3. Split-K: programs = ceil(n / block_n) * ceil(m / rows per program); if that is below
       `_TARGET_PROGRAMS_PER_SM` (4) per SM, K is split into as many slices as make up the difference, at most
       one per block_k columns, and at most k / (16 m) so that the float32 partials stay under 1/8 of the
       weight's bytes. At 132 SMs: Qwen3-0.6B's qkv (4096 x 1024) runs 128 tiles x 4 splits at m = 1, its LM
       head (151936 x 1024) 4748 tiles unsplit; Qwen3-8B's down (4096 x 12288) 128 tiles x 5 splits.

    `num_sms` is the device's SM count (`torch.cuda.get_device_properties(...).multi_processor_count`).
    """
    use_dot = m > _ELEMENTWISE_MAX_M
    if use_dot:
        block_n = _pow2_at_most(n, _DOT_BLOCK_N)
        rows_per_program = _DOT_BLOCK_M
    else:
        block_n = _pow2_at_most(n, _FMA_BLOCK_N)
        rows_per_program = 1
    block_k = _pow2_at_most(k, _TILE_ELEMENTS // block_n)
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, rows_per_program)
    wanted = triton.cdiv(_TARGET_PROGRAMS_PER_SM * num_sms, programs)
    split_k = max(1, min(wanted, triton.cdiv(k, block_k), k // (2 * _PARTIAL_BYTES_DIVISOR * m)))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot)


def _interpreter_config(m: int, n: int, k: int) -> GemvConfig:
    """The configuration for CPU tensors: the interpreter runs programs one at a time in Python, so programs
    take up to 1024 rows and K is not split, which keeps its per-program overhead small."""
    return GemvConfig(block_n=_pow2_at_most(n, 1024), block_k=_pow2_at_most(k, 128), split_k=1,
                      use_dot=m > _ELEMENTWISE_MAX_M)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# The batch size M varies from step to step: specializing on it (Triton compiles separate variants for 1,
# multiples of 16 and the rest) would compile a new variant in the middle of a run.
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
):
    # Program (n, s, m): W rows [n*BLOCK_N, ...), K columns [s*k_per_split, ...), batch rows [m*BLOCK_M, ...).
    # k_per_split is a multiple of BLOCK_K, so only the last split's last tile can run past K.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N-1 again (in bounds, no mask on the weight stream) and are never stored.
    w_rows = tl.minimum(rows, N - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + w_rows[:, None] * K + (k_start + cols)[None, :]
    if USE_DOT:
        batch = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        # x tile transposed, [BLOCK_K, BLOCK_M]: the right operand of W [BLOCK_N, BLOCK_K] @ x.T.
        x_ptrs = x_ptr + batch[None, :].to(tl.int64) * stride_xm + (k_start + cols)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=(batch < M)[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=(k + cols)[None, :] < K, other=0.0)
                x = tl.load(x_ptrs, mask=(batch < M)[None, :] & ((k + cols)[:, None] < K), other=0.0)
            if WIDEN_DOT:
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:
        # One batch row per program (BLOCK_M == 1), as a [1, BLOCK_N] tile so both paths store alike.
        batch = pid_m + tl.arange(0, 1)
        x_ptrs = x_ptr + pid_m.to(tl.int64) * stride_xm + k_start + cols
        acc1d = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(k + cols)[None, :] < K, other=0.0)
                x = tl.load(x_ptrs, mask=k + cols < K, other=0.0)
            acc1d += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = acc1d[:, None]
    # acc[i, j] = the sum over this split's K columns of W[rows[i], k] * x[batch[j], k]
    mask = (rows < N)[:, None] & (batch < M)[None, :]
    if SPLIT:
        partial_ptrs = partial_ptr + (pid_s * M + batch[None, :]).to(tl.int64) * N + rows[:, None]
        tl.store(partial_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + batch[None, :].to(tl.int64) * stride_ym + rows[:, None]
        tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _sum_splits_kernel(partial_ptr, bias_ptr, y_ptr, M, N, stride_ym, num_splits,
                       BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Program (n, m): y[m, n*BLOCK ...] = sum over splits s = 0, 1, ... (in that order) of partial[s, m, :] + bias.
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1).to(tl.int64)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(partial_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, round_to(acc, y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} input features but weight {tuple(weight.shape)} has {weight.shape[1]}")
    if weight.dtype not in GEMV_DTYPES:
        raise ValueError(f"weight dtype {weight.dtype} must be one of {GEMV_DTYPES}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x dtype {x.dtype} must equal the weight dtype {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (row-major [N, K]), got strides {weight.stride()}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have stride 1 in its last dimension, got strides {x.stride()}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(f"bias {bias.dtype} {tuple(bias.shape)} on {bias.device} must be {weight.dtype} "
                             f"({weight.shape[0]},) on {weight.device}")
        if bias.stride(0) != 1:
            raise ValueError("bias must be contiguous")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: GemvConfig | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` (`torch.nn.functional.linear`) for a small batch, reading the weight once.

    Args:
        x: `[M, K]` bfloat16 or float16, stride 1 in its last dimension; M is meant to be small (a decode
            batch, 1..16), though any M is computed correctly.
        weight: `[N, K]` in x's dtype, contiguous (`nn.Linear`'s row-major layout).
        bias: `[N]` in x's dtype, contiguous, or None.
        config: the launch configuration (tests, benchmarks); None chooses it from the shapes
            (`choose_gemv_config`).

    Returns:
        y `[M, N]`, a new contiguous tensor in x's dtype: float32 products and sums, rounded once to nearest
        even. The same inputs and config give bit-identical output on every call (no atomics).

    Raises:
        ValueError: x or weight not 2-D, mismatched K, a dtype other than bfloat16/float16 or x's and
            weight's dtypes differing, a weight that is not contiguous, x's last stride not 1, tensors on
            different devices, or a bias not `[N]` contiguous in that dtype.

    Reads no tensor value on the host and synchronises nothing, so it can be captured in a CUDA graph.
    """
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    # CPU tensors run under the Triton interpreter, whose tl.dot misreads bfloat16 operands (it multiplies
    # their bits as integers): there the tiles are widened to float32 first, which gives the same exact
    # products and float32 sums as the tensor cores.
    interpreted = x.device.type == "cpu"
    if config is None:
        config = _interpreter_config(m, n, k) if interpreted else choose_gemv_config(m, n, k, _num_sms(x.device))
    block_m = _DOT_BLOCK_M if config.use_dot else 1
    k_per_split = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k) * config.block_k
    num_splits = triton.cdiv(k, k_per_split)
    partial = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device) if num_splits > 1 else y
    grid = (triton.cdiv(n, config.block_n), num_splits, triton.cdiv(m, block_m))
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else y, y, partial, m, n, k, x.stride(0), y.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        HAS_BIAS=bias is not None, SPLIT=num_splits > 1, EVEN_K=k % config.block_k == 0,
        WIDEN_DOT=interpreted,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _sum_splits_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
            partial, bias if bias is not None else y, y, m, n, y.stride(0), num_splits,
            BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias is not None,
        )
    return y
