"""The element-wise layers before a GEMV, run inside it at a decode step of one sequence.

A decode step at batch 1 is hundreds of tiny kernels, each costing a launch gap and a ramp. Where the linear
layers take our GEMV (`workers/layers/linear.py` `linear`) with one row per program, the layer before each can
compute the GEMV's input features as the GEMV loads them (`gpu_kernels/gemv.py`): the residual add and RMSNorm before
the qkv and gate_up projections, SiLU-and-mul before down_proj. Three launches of a decoder layer go, with the
round trips of their activations.

Only at tensor-parallel size 1: at TP > 1 the norms are fused with the all-reduce instead (`RMSNorm.reduce_add`).
"""

from __future__ import annotations

import torch

from workers.layers.fused import fused_kernels_enabled
from workers.layers.linear import LinearBase, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.parallel import tp_size

# The fused kernels run one batch row per program: the GEMV's own path at batch 1 (gpu_kernels/gemv.py).
PROLOGUE_MAX_BATCH = 1
_DTYPES = (torch.bfloat16, torch.float16)


def fuses_into_gemv(x: torch.Tensor, layer: LinearBase) -> bool:
    """Whether a layer's input `x` `[T, in]` goes through the fused GEMVs: fused kernels on for x
    (`fused_kernels_enabled`), TP size 1, 1 <= T <= min(`layer.gemv_max_batch`, 1) (where `linear` takes the GEMV
    with one row per program), and a contiguous 16-bit weight of x's dtype."""
    return (x.dim() == 2 and 0 < x.shape[0] <= min(layer.gemv_max_batch, PROLOGUE_MAX_BATCH)
            and fused_kernels_enabled(x) and tp_size() == 1 and x.dtype in _DTYPES
            and layer.weight.dtype == x.dtype and layer.weight.is_contiguous() and x.stride(1) == 1)


def norm_then_linear(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                     layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor]:
    """`(layer(norm(x + residual)), x + residual)` in one kernel; with `residual` None, `(layer(norm(x)), x)`.

    x, residual `[T, hidden]` -> (`[T, out]`, `[T, hidden]`), as `norm` then `layer` compute them (see
    `gpu_kernels.gemv.add_rms_norm_gemv` for the one rounding in which they can differ)."""
    from gpu_kernels.gemv import add_rms_norm_gemv  # Triton is imported only where it runs

    return add_rms_norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.bias)


def silu_and_mul_then_linear(gate_up: torch.Tensor, layer: RowParallelLinear) -> torch.Tensor:
    """`layer(silu_and_mul(gate_up))` in one kernel: gate_up `[T, 2 * I]` -> `[T, out]`.

    The bias is added after the GEMV's rounding, as `RowParallelLinear.forward` adds it after its all-reduce."""
    from gpu_kernels.gemv import silu_and_mul_gemv  # Triton is imported only where it runs

    y = silu_and_mul_gemv(gate_up, layer.weight)
    return y + layer.bias if layer.bias is not None else y
