"""Attention backends behind one interface, chosen by name.

- "torch": plain torch over the paged cache; runs anywhere (the CPU path).
- "triton": our Triton kernels (`kernels/`); needs a GPU, or TRITON_INTERPRET=1 on CPU (tests).
- "flash-attn": FlashAttention-4 (`flash_attn.cute`) or flash-attn 2 (`flash_attn`), whichever is
  installed; CUDA only.
- "auto": flash-attn when installed and usable on this GPU, else triton on a GPU, torch on CPU.
"""

from __future__ import annotations

import os

import torch

from workers.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend"]


def create_attention_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                             block_size: int) -> AttentionBackend:
    """The backend called `name` for this device. Raises `RuntimeError` when it cannot run here."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            from workers.attention import flash_backend

            name = "flash-attn" if flash_backend.usable(device, dtype, head_dim, block_size) else "triton"
    if name == "torch":
        from workers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
        from workers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash-attn":
        from workers.attention import flash_backend

        return flash_backend.create(device, dtype, head_dim, block_size)
    raise ValueError(f"unknown attention backend {name!r}")
