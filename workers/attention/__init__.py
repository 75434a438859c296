"""Attention backends behind one interface, chosen by name.

- "torch": plain torch over the paged cache; runs anywhere (the CPU path).
- "triton": our Triton kernels (`gpu_kernels/`); needs a GPU, or TRITON_INTERPRET=1 on CPU (tests).
- "flash-attn": FlashAttention-4 (`flash_attn.cute`) or flash-attn 2 (`flash_attn`), whichever is
  installed; CUDA only.
- "auto": triton on a GPU, torch on CPU. On an H200 our Triton kernels beat FlashAttention-4 on the
  reference benchmark (22,680 vs 18,900 output tokens/s; decode reads the paged cache at 3.9 vs
  2.9 TB/s, benchmarks/RESULTS.md), so FlashAttention is used only when asked for by name.
"""

from __future__ import annotations

import os

import torch

from common.config import ConfigError
from common.errors import ExplainedError
from workers.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend"]


def create_attention_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                             block_size: int) -> AttentionBackend:
    """The backend called `name` for this device. Raises `RuntimeError` when it cannot run here."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from workers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ExplainedError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
        from workers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash-attn":
        from workers.attention import flash_backend

        return flash_backend.create(device, dtype, head_dim, block_size)
    raise ConfigError(f"unknown attention backend {name!r}")
