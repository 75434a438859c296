"""Rotary position embedding (RoPE, Su et al. 2021) with the checkpoint's rope parameters.

The inverse frequencies come from `transformers`' own rope initialisers
(`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`: linear, yarn, llama3, longrope, ...),
so every scaling scheme a checkpoint declares is honoured exactly as Hugging Face applies it.
Dynamic NTK scaling depends on the running sequence length and is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.layers.fused import fused


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's rope settings as one dict (transformers 5 `rope_parameters`, or 4.x fields)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq `[head_dim // 2]` float32, attention scaling factor applied to cos and sin)."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float(), 1.0
    if rope_type == "dynamic":
        raise NotImplementedError("dynamic NTK rope scaling is not supported (it depends on the live length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_type {rope_type!r} is not known to this transformers version")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position, in the "rotate half" layout Llama and Qwen use."""

    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=inv_freq.device), inv_freq)
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` int64; q `[T, Hq, D]`, k `[T, Hk, D]` -> rotated (q, k), same dtype."""
        return apply_rotary(positions, q, k, self.cos_sin_cache)


@fused
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
