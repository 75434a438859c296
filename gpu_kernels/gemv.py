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
  float32 partial sums to a `[split_k, M, N]` buffer and then counts itself in an int32 counter of its output
  tile (an atomic add with acquire-release semantics); the program that arrives last adds ALL the tile's
  partials in split order 0, 1, 2, ..., then the bias, writes y and sets the counter back to 0. One launch, and
  the bits never depend on which split finished when. (`GemvConfig.one_launch=False` runs the earlier design,
  a second kernel that adds the partials in the same order: the same bits in two launches.)
- On the element-wise path the layer before the GEMV can run inside it (`silu_and_mul_gemv`,
  `add_rms_norm_gemv`): each program computes its input features from the layer's inputs as it loads them, so
  a decode step of one sequence skips a launch and a round trip of the activations per fused layer.

The launch configuration comes from the shapes alone (`choose_gemv_config`, documented there), never from
timing runs, and no tensor value is read on the host: a call can be captured in a CUDA graph. Accumulation is
float32 throughout; the result is rounded once, to nearest even.

The design follows the split-K GEMV kernels of the Triton community for decode (e.g. PyTorch's
"Accelerating a Triton fused kernel for W4A16 quantized inference with SplitK work decomposition", Hoque,
Wright et al. 2024), with a deterministic reduction in place of their atomic adds of partial sums: the
"last block" pattern of the CUDA samples' threadFenceReduction, where only an arrival counter is atomic.

Split-K counters: `gpu_kernels/split_counters.py`, one persistent zeroed workspace per device that each launch leaves
zeroed. A caller that captures CUDA graphs must make one eager split-K call on each device before the first capture
(the model runner's warm-up forward does): allocating inside a capture raises.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpu_kernels.pdl import launch_options, pdl_for
from gpu_kernels.rounding import round_to
from gpu_kernels.split_counters import split_counters

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
    one_launch: with several splits, the last split program of each output tile to finish adds the tile's
        partials (one launch); False: a second kernel adds them (two launches, kept for comparison). The same
        bits either way.
    """

    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3
    one_launch: bool = True

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


# CUDA's expf and rsqrtf (libdevice), what eager torch and torch.compile's kernels call on the GPU. The interpreter
# has no libdevice: there tl's own functions are numpy's float32 exp and 1/sqrt.
if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _exp(x):
        return tl.exp(x)

    @triton.jit
    def _rsqrt(x):
        return tl.rsqrt(x)
else:
    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _rsqrt(x):
        return libdevice.rsqrt(x)


@triton.jit
def _load_features(ptr, offs, K, MASKED: tl.constexpr):
    if MASKED:
        values = tl.load(ptr + offs, mask=offs < K, other=0.0)
    else:
        values = tl.load(ptr + offs)
    return values


@triton.jit
def _residual_sum(x_ptr, res_ptr, offs, K, MASKED: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # h = x + residual rounded to x's dtype, as torch adds two 16-bit tensors; x itself without a residual.
    h = _load_features(x_ptr, offs, K, MASKED)
    if HAS_RESIDUAL:
        r = _load_features(res_ptr, offs, K, MASKED)
        h = round_to(h.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
    return h


@triton.jit
def _inverse_rms(x_ptr, res_ptr, h_ptr, K, eps, h_stored, BLOCK_K: tl.constexpr, MASKED: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr):
    # rsqrt(mean(h^2) + eps) over the whole row of h, in float32; its first `h_stored` features (K or 0) are
    # stored to h_ptr too.
    cols = tl.arange(0, BLOCK_K)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        h = _residual_sum(x_ptr, res_ptr, k + cols, K, MASKED, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_ptr + k + cols, h, mask=k + cols < h_stored)
        h32 = h.to(tl.float32)
        squares += h32 * h32
    return _rsqrt(tl.div_rn(tl.sum(squares, axis=0), K.to(tl.float32)) + eps)


@triton.jit
def silu_mul(g, u, dtype: tl.constexpr):
    """SwiGLU's `silu(g) * u` for float32 `g`, `u` (any shape), in `dtype`: silu(g) = g / (1 + exp(-g)) in float32
    rounded to `dtype`, times u in float32, rounded again (eager torch's roundings)."""
    silu = round_to(g / (1.0 + _exp(-g)), dtype).to(tl.float32)
    return round_to(silu * u, dtype)


@triton.jit
def _input_features(x_ptr, res_ptr, norm_w_ptr, offs, K, inv_rms, MASKED: tl.constexpr, SILU_MUL: tl.constexpr,
                    RMS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # float32 input features `offs` of one batch row, as the layer before the GEMV rounds them to x's dtype.
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    if SILU_MUL:
        # x_ptr: the row of [gate | up], 2K wide. silu(g) = g / (1 + exp(-g)) in float32 rounded to the model
        # dtype, times u in float32, rounded again: eager torch's roundings, which workers/layers/activation.py
        # keeps compiled (emulate_precision_casts), with the code torch.compile generates for it (its SiLU
        # decomposition, libdevice's exp, Triton's float32 division).
        g = _load_features(x_ptr, offs, K, MASKED).to(tl.float32)
        u = _load_features(x_ptr + K, offs, K, MASKED).to(tl.float32)
        features = silu_mul(g, u, dtype).to(tl.float32)
    elif RMS_NORM:
        # weight * round(h * inv_rms), rounded: eager torch's two roundings, which workers/layers/norm.py keeps
        # compiled (emulate_precision_casts).
        h = _residual_sum(x_ptr, res_ptr, offs, K, MASKED, HAS_RESIDUAL).to(tl.float32)
        w = _load_features(norm_w_ptr, offs, K, MASKED).to(tl.float32)
        normed = round_to(h * inv_rms, dtype).to(tl.float32)
        features = round_to(w * normed, dtype).to(tl.float32)
    else:
        features = _load_features(x_ptr, offs, K, MASKED).to(tl.float32)
    return features


@triton.jit
def _add_bias_and_store(acc, bias_ptr, y_ptr, rows, batch, N, stride_ym, mask, HAS_BIAS: tl.constexpr):
    # acc [BLOCK_N, BLOCK_M] float32: y[batch, rows] = round(acc + bias).
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + batch[None, :].to(tl.int64) * stride_ym + rows[:, None]
    tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty), mask=mask)


# The batch size M varies from step to step: specializing on it (Triton compiles separate variants for 1,
# multiples of 16 and the rest) would compile a new variant in the middle of a run.
@triton.jit(do_not_specialize=["M", "eps"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    res_ptr,
    norm_w_ptr,
    h_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    k_per_split,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    ONE_LAUNCH: tl.constexpr,
    EVEN_K: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    RMS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (n, s, m): W rows [n*BLOCK_N, ...), K columns [s*k_per_split, ...), batch rows [m*BLOCK_M, ...).
    # k_per_split is a multiple of BLOCK_K, so only the last split's last tile can run past K.
    tl.static_assert(not (USE_DOT and (SILU_MUL or RMS_NORM)), "the fused prologues run on the element-wise path")
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
    if PDL:  # gpu_kernels/pdl.py: the kernel before this one has finished and its memory is visible
        tl.extra.cuda.gdc_wait()
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
        row = pid_m.to(tl.int64)
        x_row = x_ptr + row * stride_xm
        res_row = res_ptr + row * K
        inv_rms = 0.0
        if RMS_NORM:
            # Every program reads the whole row (K 16-bit values, from L2 after the first); the program of the
            # first tile and split writes h, into a buffer no program reads.
            h_stored = tl.where((pid_n == 0) & (pid_s == 0), K, 0)
            inv_rms = _inverse_rms(x_row, res_row, h_ptr + row * K, K, eps, h_stored, BLOCK_K, not EVEN_K,
                                   HAS_RESIDUAL)
        acc1d = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(k + cols)[None, :] < K, other=0.0)
            x = _input_features(x_row, res_row, norm_w_ptr, k + cols, K, inv_rms, not EVEN_K, SILU_MUL, RMS_NORM,
                                HAS_RESIDUAL)
            acc1d += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            w_ptrs += BLOCK_K
        acc = acc1d[:, None]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # acc[i, j] = the sum over this split's K columns of W[rows[i], k] * x[batch[j], k]
    mask = (rows < N)[:, None] & (batch < M)[None, :]
    if SPLIT:
        partial_ptrs = partial_ptr + (pid_s * M + batch[None, :]).to(tl.int64) * N + rows[:, None]
        tl.store(partial_ptrs, acc, mask=mask)
        if ONE_LAUNCH:
            num_splits = tl.num_programs(1)
            counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
            # All of this program's partial is stored before its one thread's release of the counter.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == num_splits - 1:
                # Every split's partial is visible (acquire); .cg reads them from L2, past this SM's L1.
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(0, num_splits):
                    total += tl.load(partial_ptr + (s * M + batch[None, :]).to(tl.int64) * N + rows[:, None],
                                     mask=mask, other=0.0, cache_modifier=".cg")
                _add_bias_and_store(total, bias_ptr, y_ptr, rows, batch, N, stride_ym, mask, HAS_BIAS)
                # No other program of this launch touches the counter again: the next launch finds it 0.
                tl.store(counter, 0)
    else:
        _add_bias_and_store(acc, bias_ptr, y_ptr, rows, batch, N, stride_ym, mask, HAS_BIAS)


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


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_features: int | None = None) -> None:
    # x_features: the input features x must have (default: weight's K).
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    if x.shape[1] != (weight.shape[1] if x_features is None else x_features):
        raise ValueError(f"x has {x.shape[1]} input features but weight {tuple(weight.shape)} has {weight.shape[1]}"
                         + ("" if x_features is None else f" (x must have {x_features})"))
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


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            config: GemvConfig, *, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            h: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False) -> None:
    """Run the kernel(s) into y `[M, N]` (M, N, K >= 1; inputs checked)."""
    m, n = y.shape
    k = weight.shape[1]
    interpreted = x.device.type == "cpu"
    pdl = pdl_for(x)
    block_m = _DOT_BLOCK_M if config.use_dot else 1
    k_per_split = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k) * config.block_k
    num_splits = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, config.block_n), num_splits, triton.cdiv(m, block_m))
    one_launch = num_splits > 1 and config.one_launch
    partial = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device) if num_splits > 1 else y
    # Every grid the heuristic splits has fewer tiles than it wants programs (it splits only below that many).
    counters = (split_counters(x.device, grid[0] * grid[2], "gemv", _TARGET_PROGRAMS_PER_SM * _num_sms(x.device))
                if one_launch else y)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else y, y, partial, counters,
        residual if residual is not None else y, norm_weight if norm_weight is not None else y,
        h if h is not None else y,
        m, n, k, x.stride(0), y.stride(0), k_per_split, eps,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        HAS_BIAS=bias is not None, SPLIT=num_splits > 1, ONE_LAUNCH=one_launch, EVEN_K=k % config.block_k == 0,
        WIDEN_DOT=interpreted, SILU_MUL=silu_mul, RMS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
    )
    if num_splits > 1 and not one_launch:
        _sum_splits_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
            partial, bias if bias is not None else y, y, m, n, y.stride(0), num_splits,
            BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias is not None,
        )


def _default_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    # CPU tensors run under the Triton interpreter, whose tl.dot misreads bfloat16 operands (it multiplies
    # their bits as integers): there the tiles are widened to float32 first (WIDEN_DOT), which gives the same
    # exact products and float32 sums as the tensor cores.
    if device.type == "cpu":
        return _interpreter_config(m, n, k)
    return choose_gemv_config(m, n, k, _num_sms(device))


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
        even. The same inputs and config give bit-identical output on every call (no atomic adds of values).

    Raises:
        ValueError: x or weight not 2-D, mismatched K, a dtype other than bfloat16/float16 or x's and
            weight's dtypes differing, a weight that is not contiguous, x's last stride not 1, tensors on
            different devices, or a bias not `[N]` contiguous in that dtype.
        RuntimeError: the first split-K call on a device made inside a CUDA graph capture (see the module
            docstring: the split-K counters are allocated by an eager call).

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
    _launch(x, weight, bias, y, config or _default_config(m, n, k, x.device))
    return y


def _prologue_config(config: GemvConfig | None, n: int, k: int, device: torch.device) -> GemvConfig:
    # The fused prologues run one batch row per program: the configuration of M = 1, whatever M is.
    config = config or _default_config(1, n, k, device)
    if config.use_dot:
        raise ValueError("the fused prologues run on the element-wise path: config.use_dot must be False")
    return config


def silu_and_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      config: GemvConfig | None = None) -> torch.Tensor:
    """`gemv(silu_and_mul(gate_up), weight, bias)` in one kernel: SwiGLU's gate computed as the GEMV loads it.

    Input feature k is `silu(gate[k]) * up[k]` with `silu(g) = g / (1 + exp(-g))` computed in float32 and
    rounded to the model dtype, then the product computed in float32 and rounded: the roundings of eager torch,
    which `workers/layers/activation.py`'s `silu_and_mul` keeps when compiled on a GPU (workers/layers/fused.py:
    `emulate_precision_casts`); tests/kernels/test_gemv_gpu.py compares the two there.

    Args:
        gate_up: `[M, 2K]` bfloat16 or float16, `[gate | up]` (MergedColumnParallelLinear's output), stride 1 in
            its last dimension. One program per batch row: meant for M = 1.
        weight: `[N, K]` in gate_up's dtype, contiguous. bias: `[N]` or None.
        config: an element-wise launch configuration (`use_dot=False`); None: M = 1's (`choose_gemv_config`).

    Returns:
        y `[M, N]` in gate_up's dtype: float32 products and sums rounded once, the same bits on every call.

    Raises:
        ValueError: as `gemv` (with gate_up 2K wide), or a configuration with `use_dot`.
        RuntimeError: as `gemv`.
    """
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    _check(gate_up, weight, bias, x_features=2 * k)
    m = gate_up.shape[0]
    y = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    _launch(gate_up, weight, bias, y, _prologue_config(config, n, k, gate_up.device), silu_mul=True)
    return y


def add_rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(gemv(rms_norm(h), weight, bias), h)` with `h = x + residual` (or x), in one kernel.

    As `workers/layers/norm.py`'s `add_rms_norm` computes it compiled (as it runs on a GPU): h = x + residual
    rounded to the model dtype; then, in float32, inv_rms = rsqrt(mean(h^2) + eps) (Zhang & Sennrich 2019) and
    feature k = norm_weight[k] * round(h[k] * inv_rms), rounded to the model dtype: eager torch's roundings,
    which the compiled layer keeps (workers/layers/fused.py: `emulate_precision_casts`). Every program computes
    inv_rms from the whole row itself; the row's first program writes h to a new tensor (never into x or
    residual, which other programs are still reading). The mean
    square's summation order is the kernel's own, so a feature can differ from the unfused layer's by one
    rounding where inv_rms differs in its last bits (about 1 in 100 features at K = 1024).

    Args:
        x: `[M, K]` bfloat16 or float16, stride 1 in its last dimension (the previous layer's output, or the
            embeddings). One program per batch row: meant for M = 1.
        residual: `[M, K]` contiguous in x's dtype, or None (the first layer: h is x).
        norm_weight: `[K]` contiguous in x's dtype. eps: added to the mean square.
        weight: `[N, K]` in x's dtype, contiguous. bias: `[N]` or None.
        config: an element-wise launch configuration (`use_dot=False`); None: M = 1's (`choose_gemv_config`).

    Returns:
        (y `[M, N]`, h `[M, K]`) in x's dtype; h is x itself when residual is None, else a new contiguous tensor.

    Raises:
        ValueError: as `gemv`, a residual or norm_weight of another shape, dtype, device or layout, or a
            configuration with `use_dot`.
        RuntimeError: as `gemv`.
    """
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or not residual.is_contiguous()):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} on {residual.device} must be "
                         f"contiguous {x.dtype} {tuple(x.shape)} on {x.device}")
    if (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or norm_weight.device != x.device
            or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight {norm_weight.dtype} {tuple(norm_weight.shape)} on {norm_weight.device} must "
                         f"be contiguous {x.dtype} ({k},) on {x.device}")
    if k == 0:
        raise ValueError("add_rms_norm_gemv needs at least one input feature (K >= 1)")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return y, h
    if n == 0:  # no program runs to write h
        return y, x + residual if residual is not None else x
    _launch(x, weight, bias, y, _prologue_config(config, n, k, x.device), residual=residual,
            norm_weight=norm_weight, h=h, eps=eps)
    return y, h
