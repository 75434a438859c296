"""Triton kernels of the GPU worker: the KV cache store (alone, or fused with QK-norm and RoPE) and
paged attention (prefill, decode).

The paged KV cache layout is FlashAttention's: `[num_blocks, block_size, num_kv_heads, head_dim]`
per layer for keys and for values; see `gpu_kernels/paged_attention.py`.
"""

from gpu_kernels.kv_store import store_kvcache
from gpu_kernels.paged_decode import choose_num_splits, paged_attention_decode
from gpu_kernels.paged_prefill import paged_attention_prefill
from gpu_kernels.rope_kv_store import qk_norm_rope_store

__all__ = ["choose_num_splits", "paged_attention_decode", "paged_attention_prefill", "qk_norm_rope_store",
           "store_kvcache"]
