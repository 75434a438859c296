"""FlashAttention over the paged KV cache: FlashAttention-4 (`flash_attn.cute`, Hopper and newer,
installs from PyPI as flash-attn-4) when installed, else flash-attn 2 (`flash_attn`).

Keys and values are written with our Triton store kernel; FlashAttention then reads the whole
context through the block table:
- FlashAttention-4: `flash_attn.cute.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=...,
  seqused_k=..., page_table=..., causal=True)` for prefill, decode and mixed steps alike.
- flash-attn 2: `flash_attn_varlen_func(..., block_table=...)` (it needs cumulative key lengths and
  a block size that is a multiple of 256) and `flash_attn_with_kvcache` for decode.

Neither reads our fp8 KV cache: the engine refuses `kv_cache_dtype="fp8"` with this backend
(`EngineConfig`), so the caches here always hold the model's dtype and the scales are 1.0.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from common.errors import ExplainedError
from gpu_kernels import store_kvcache
from workers.attention.base import AttentionBackend, AttentionMetadata

FA4_HEAD_DIMS = (64, 96, 128)


def _fa4_available() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


def _fa2_available() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec(
            "flash_attn.flash_attn_interface") is not None
    except ModuleNotFoundError:
        return False


def why_unusable(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> str | None:
    """None if some FlashAttention can run this configuration, else the reason."""
    if device.type != "cuda":
        return "FlashAttention needs a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention needs float16 or bfloat16, not {dtype}"
    major, _ = torch.cuda.get_device_capability(device)
    if _fa4_available() and major >= 9 and head_dim in FA4_HEAD_DIMS:
        return None
    if _fa2_available() and major >= 8 and head_dim <= 256 and block_size % 256 == 0:
        return None
    if not _fa4_available() and not _fa2_available():
        return "neither flash-attn-4 (flash_attn.cute) nor flash-attn 2 is installed"
    return (f"no installed FlashAttention supports compute capability {major}.x with head_dim {head_dim} "
            f"and block_size {block_size} (FA4: sm90+, head_dim {FA4_HEAD_DIMS}; FA2: block_size % 256 == 0)")


def usable(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    return why_unusable(device, dtype, head_dim, block_size) is None


def create(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> AttentionBackend:
    """The FlashAttention backend for this device. Raises `RuntimeError` saying why when none can run."""
    reason = why_unusable(device, dtype, head_dim, block_size)
    if reason is not None:
        raise ExplainedError(f"attention backend 'flash-attn' cannot run here: {reason}")
    major, _ = torch.cuda.get_device_capability(device)
    if _fa4_available() and major >= 9 and head_dim in FA4_HEAD_DIMS:
        return FlashAttention4Backend()
    return FlashAttention2Backend()


def _require_model_dtype(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    if k_cache.dtype == torch.float8_e4m3fn or k_scale != 1.0 or v_scale != 1.0:
        raise ValueError("the flash-attn backend does not read an fp8 KV cache")


class FlashAttention4Backend(AttentionBackend):
    name = "flash-attn-4"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        from flash_attn.cute import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
        _require_model_dtype(k_cache, k_scale, v_scale)
        out = self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens,
                           max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
                           page_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out


class FlashAttention2Backend(AttentionBackend):
    name = "flash-attn-2"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
        _require_model_dtype(k_cache, k_scale, v_scale)
        if meta.is_decode:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                     block_table=meta.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len, softmax_scale=scale,
                            causal=True, block_table=meta.block_tables)
