"""The attention layer: the model-facing side of the paged KV cache.

It reshapes q/k/v into heads and hands them, with this layer's slice of the KV cache and the
step's `AttentionMetadata`, to the worker's attention backend (torch, Triton or FlashAttention),
which stores k/v into the cache by slot mapping and attends over the cached context. `attend`
skips the store, for a model whose fused kernel already wrote this step's k/v into `k_cache` and
`v_cache` (`gpu_kernels/rope_kv_store.py`). An fp8 cache comes with this layer's `k_scale` and `v_scale`
(`workers/kv_cache.py`), set by the model runner before the cache is bound.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.attention.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound by the model runner once the KV cache exists: [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = 1.0  # dequantization scales of an fp8 cache; 1.0 for the model's dtype
        self.v_scale = 1.0
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q `[T, Hq*D]`, k/v `[T, Hk*D]` (views of the fused qkv output) -> `[T, Hq*D]`."""
        assert self.backend is not None, "the model runner binds a backend before the first forward"
        d = self.head_dim
        out = self.backend.forward(
            q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d), v.view(-1, self.num_kv_heads, d),
            self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale)
        return out.view(-1, self.num_heads * d)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q `[T, Hq, D]`, with this step's k/v already in `k_cache`/`v_cache` -> `[T, Hq*D]`."""
        assert self.backend is not None, "the model runner binds a backend before the first forward"
        out = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale)
        return out.view(-1, self.num_heads * self.head_dim)
