"""Model architectures by the name in config.json's `architectures`."""

from __future__ import annotations

from torch import nn

from workers.models.llama import LlamaForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral is Llama's layout; its sliding window is refused by EngineConfig when it could matter.
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
