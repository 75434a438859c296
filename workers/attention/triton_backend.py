"""Attention with our own Triton kernels (`kernels/`): KV store, varlen paged prefill, split-KV decode."""

from __future__ import annotations

import torch

from kernels import paged_attention_decode, paged_attention_prefill, store_kvcache
from workers.attention.base import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # decode reads no tensor value on the host

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode:
            return paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       meta.max_query_len, scale)
