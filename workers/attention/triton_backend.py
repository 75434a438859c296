"""Attention with our own Triton kernels (`gpu_kernels/`): KV store, varlen paged prefill, split-KV decode;
over a cache in the model's dtype or an fp8 (e4m3fn) one. In deterministic mode (workers/deterministic.py) the
prefill kernel serves decode rows too, with one launch configuration and every KV tile on its masked path."""

from __future__ import annotations

import torch

from gpu_kernels import paged_attention_decode, paged_attention_prefill, store_kvcache
from gpu_kernels.paged_prefill import deterministic_launch_config
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
        if deterministic():  # one kernel and one configuration for every token (gpu_kernels/paged_prefill.py)
            config = deterministic_launch_config(q.shape[1] // k_cache.shape[2])
            return paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                           meta.seq_lens, meta.max_query_len, scale, k_scale=k_scale,
                                           v_scale=v_scale, launch_config=config, mask_every_tile=True)
        if meta.is_decode:
            return paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          k_scale=k_scale, v_scale=v_scale)
        return paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       meta.max_query_len, scale, k_scale=k_scale, v_scale=v_scale)
