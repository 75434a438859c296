"""Attention with our own Triton kernels (`gpu_kernels/`): KV store, varlen paged prefill, split-KV decode;
over a cache in the model's dtype or an fp8 (e4m3fn) one. In deterministic mode (workers/deterministic.py) every
token, prefill or decode, goes through gpu_kernels/deterministic_attention.py, whose order of operations is fixed
by the token's position alone."""

from __future__ import annotations

import torch

from gpu_kernels import paged_attention_decode, paged_attention_prefill, store_kvcache
from gpu_kernels.deterministic_attention import deterministic_attention
from workers.attention.base import AttentionBackend, AttentionMetadata
from workers.deterministic import deterministic


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # decode reads no tensor value on the host

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
        if deterministic():  # one order of operations for every token (gpu_kernels/deterministic_attention.py)
            return deterministic_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                           meta.seq_lens, meta.max_query_len, scale, k_scale=k_scale,
                                           v_scale=v_scale)
        if meta.is_decode:
            return paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          k_scale=k_scale, v_scale=v_scale)
        return paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       meta.max_query_len, scale, k_scale=k_scale, v_scale=v_scale)
