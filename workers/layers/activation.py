"""SwiGLU's gate (Shazeer 2020): silu(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.deterministic import deterministic
from workers.layers.fused import fused


@fused
def _silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[num_tokens, 2 * I]` -> `silu(gate) * up`, `[num_tokens, I]`. Deterministic mode on a GPU runs without
    torch.compile, so there one Triton kernel (`gpu_kernels.batch_invariant.silu_and_mul_rows`) takes the place of
    eager torch's two; the rest compiles it (workers/layers/fused.py), or runs it eagerly."""
    if x.is_cuda and deterministic():
        from gpu_kernels.batch_invariant import silu_and_mul_rows  # Triton is imported only where it runs
        return silu_and_mul_rows(x)
    return _silu_and_mul_torch(x)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[num_tokens, 2 * I]` -> `[num_tokens, I]`."""
        return silu_and_mul(x)
