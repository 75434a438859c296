"""Qwen3 dense decoder: the Llama layout plus a per-head RMSNorm on q and k before RoPE
(the "QK-norm" of the Qwen3 technical report), no q/k/v bias."""

from __future__ import annotations

from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
