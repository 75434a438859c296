"""Llama-family decoder (Llama 2/3, SmolLM2, ...), written for paged attention and tensor parallelism.

Matches `transformers`' LlamaForCausalLM on the same weights: pre-norm decoder layers, RoPE,
grouped-query attention, SwiGLU MLP, tied or untied LM head. q/k/v and gate/up are fused
matmuls; `packed_modules_mapping` tells the loader which checkpoint tensor fills which part.
When the fused kernels are on (CUDA, not `enforce_eager`), QK-norm, RoPE and the KV-cache store
run as one Triton kernel (`gpu_kernels/rope_kv_store.py`) between the qkv projection and attention, and at a
decode step of one sequence (TP 1) the norms and SiLU-and-mul run inside the GEMVs after them
(`workers/layers/gemv_prologue.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.attention.base import AttentionMetadata
from workers.layers.activation import SiluAndMul
from workers.layers.attention import Attention
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.fused import qk_norm_rope_store_fused
from workers.layers.gemv_prologue import fuses_into_gemv, norm_then_linear, silu_and_mul_then_linear
from workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    qk_norm = False  # Qwen3 normalises each q and k head before RoPE

    def __init__(self, cfg: Any, max_position: int) -> None:
        super().__init__()
        d = head_dim_of(cfg)
        num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, num_kv, bias=bias)
        # o_proj and down_proj leave their sums to the norms after them (RMSNorm.reduce_add)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=bias, reduce_results=False)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.rotary_emb = RotaryEmbedding(cfg, d, max_position)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d**-0.5)
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """positions `[T]` int64, x `[T, hidden_size]` -> `[T, hidden_size]`, this rank's partial sum
        of the output (o_proj does not all-reduce); stores this step's k/v."""
        return self.forward_qkv(positions, self.qkv_proj(x), meta)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`forward` from the qkv projection's output `[T, (Hq + 2*Hk) * D]` on."""
        if qk_norm_rope_store_fused(qkv):
            return self.o_proj(self.attn.attend(self._norm_rope_store_fused(positions, qkv, meta), meta))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))

    def _norm_rope_store_fused(self, positions: torch.Tensor, qkv: torch.Tensor,
                               meta: AttentionMetadata) -> torch.Tensor:
        """qkv `[T, (Hq + 2*Hk) * D]` -> q `[T, Hq, D]` normed and rotated; k normed, rotated and v
        stored into this layer's KV cache; one kernel, same numbers as the unfused path."""
        from gpu_kernels import qk_norm_rope_store  # Triton is imported only where it runs

        q_weight = k_weight = None
        eps = 0.0
        if self.qk_norm:  # q_norm and k_norm share the config's rms_norm_eps
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return qk_norm_rope_store(qkv, positions, self.rotary_emb.cos_sin_cache, q_weight, k_weight, eps,
                                  self.attn.k_cache, self.attn.v_cache, meta.slot_mapping, self.num_heads,
                                  self.num_kv_heads, self.head_dim, k_scale=self.attn.k_scale,
                                  v_scale=self.attn.v_scale)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias, reduce_results=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden_size]` -> this rank's partial sum of the output (down_proj does not all-reduce)."""
        gate_up = self.gate_up_proj(x)
        return self.down_proj(self.act_fn(gate_up))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: Any, max_position: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, max_position)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embeddings (first layer, `residual` None) or the previous layer's partial MLP
        output. Returns (this layer's partial MLP output, residual stream before it); the sums over
        ranks happen in the norms (all-reduce + residual add + RMSNorm)."""
        if fuses_into_gemv(x, self.mlp.down_proj):  # one sequence's decode step: the same layers, three kernels fewer
            return self._forward_in_gemvs(positions, x, residual, meta)
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.reduce_add(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm.reduce_add(x, residual)
        return self.mlp(x), residual

    def _forward_in_gemvs(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                          meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with each norm inside the GEMV after it, and SiLU-and-mul inside down_proj's."""
        qkv, residual = norm_then_linear(self.input_layernorm, x, residual, self.self_attn.qkv_proj)
        x = self.self_attn.forward_qkv(positions, qkv, meta)
        gate_up, residual = norm_then_linear(self.post_attention_layernorm, x, residual, self.mlp.gate_up_proj)
        return silu_and_mul_then_linear(gate_up, self.mlp.down_proj), residual


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: Any, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([self.layer_cls(cfg, max_position) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm.reduce_add(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """input ids `[T]` int64 and positions `[T]` int64 -> hidden states `[T, hidden_size]`;
    `compute_logits(hidden)` -> `[n, vocab slice]` logits of this rank's vocabulary slice (all of it at TP=1)."""

    model_cls: type[LlamaModel] = LlamaModel
    # checkpoint name part -> (fused parameter name part, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Any, max_position: int) -> None:
        super().__init__()
        self.model = self.model_cls(cfg, max_position)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
