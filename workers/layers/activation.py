"""SwiGLU's gate (Shazeer 2020): silu(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.fused import fused


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[num_tokens, 2 * I]` -> `[num_tokens, I]`."""
        return silu_and_mul(x)
