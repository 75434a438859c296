"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add before it, and at tensor
parallelism with the all-reduce before that."""

from __future__ import annotations

import torch
from torch import nn

from workers import parallel
from workers.deterministic import deterministic
from workers.layers.fused import fused, fused_kernels_enabled


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x `[..., hidden]`. With `residual`, returns (norm(x + residual), x + residual). In deterministic mode
        (workers/deterministic.py) the batch-invariant RMSNorm."""
        if deterministic():
            from gpu_kernels.batch_invariant import rms_norm_batch_invariant

            return rms_norm_batch_invariant(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def reduce_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, hidden]`: this rank's partial output of a row-parallel layer (`reduce_results=False`).
        Returns (norm(sum of x over ranks + residual), sum + residual); `residual` may be updated in
        place. At TP > 1 on GPUs with the fused kernels on, the three steps are one kernel."""
        if parallel.tp_size() > 1:
            if fused_kernels_enabled(x):
                done = parallel.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
                if done is not None:
                    return done
            x = parallel.all_reduce(x)
        return self(x, residual)
