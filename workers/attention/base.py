"""The attention-backend contract and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache. B sequences, T tokens in all.

    - `slot_mapping` `[T]` int64: cache slot of each token's k/v (`block_id * block_size + offset`);
      -1 marks a padding token whose k/v must not be stored.
    - `query_start_loc` `[B+1]` int32: cu_seqlens_q; sequence b's tokens are rows
      `query_start_loc[b]:query_start_loc[b+1]` of q.
    - `seq_lens` `[B]` int32: each sequence's KV length after this step (context + new tokens);
      0 marks a padding sequence (CUDA-graph padding), which must read nothing.
    - `block_tables` `[B, W]` int32: block ids of each sequence; entries past
      `ceil(seq_len / block_size)` are unused and may hold anything.
    - `max_query_len`, `max_seq_len`: host-side upper bounds, in tokens.
    - `is_decode`: every sequence has exactly one query token (decode kernels and CUDA graphs).
    - `query_start_loc_cpu`, `seq_lens_cpu`: host copies (numpy) when available, for the CPU backend.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    query_start_loc_cpu: np.ndarray | None = None
    seq_lens_cpu: np.ndarray | None = None


class AttentionBackend(ABC):
    """Stores this step's k/v into the paged cache, then computes causal attention of q over the
    whole cached context of each sequence (so prefix-cache hits and earlier prefill chunks are
    read from the cache like any other context).

    `forward` is `store` then `attend`. A model whose k/v for this step were already written into
    the cache by a fused kernel (`gpu_kernels/rope_kv_store.py`) calls `attend` alone.

    The caches hold the model's dtype, or float8 e4m3fn (an fp8 KV cache, `workers/kv_cache.py`):
    `store` then writes `e4m3(k / k_scale)` and `e4m3(v / v_scale)`, and `attend` reads
    `code * scale`. `k_scale` and `v_scale` are the layer's scales, 1.0 for a cache in the model's dtype.
    """

    name: ClassVar[str] = ""
    supports_cuda_graphs: ClassVar[bool] = False

    @abstractmethod
    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write k/v `[T, Hk, D]` into the caches `[num_blocks, block_size, Hk, D]` at `meta.slot_mapping`
        (slots of -1 are skipped)."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q `[T, Hq, D]` over caches `[num_blocks, block_size, Hk, D]` that already hold this step's
        k/v -> out `[T, Hq, D]` in q's dtype. Hq must be a multiple of Hk (grouped-query attention)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hk, D]`, caches `[num_blocks, block_size, Hk, D]` -> out `[T, Hq, D]`
        in q's dtype: `store` then `attend`."""
        self.store(k, v, k_cache, v_cache, meta, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
