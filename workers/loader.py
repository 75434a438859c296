"""Load a Hugging Face checkpoint into a model: on which device, in which dtype, and its *.safetensors
shard by shard.

Each checkpoint tensor is routed to a parameter; names listed in the model's
`packed_modules_mapping` (q_proj -> qkv_proj shard "q", gate_proj -> gate_up_proj shard 0, ...)
go to the fused parameter's loader with their shard id. Parameters' own `weight_loader`s cut
out this rank's slice, so tensor parallelism needs nothing here.

Those loaders slice what they need out of the checkpoint tensor, so a tensor larger than the
model (config.json's vocab_size below the embedding's rows, say) would load truncated without a
word. Every tensor's shape is therefore checked against the shape config.json implies first.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from common.config import ConfigError, EngineConfig
from common.errors import ExplainedError
from workers.models import MODEL_REGISTRY
from workers.models.llama import head_dim_of


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Within it, floating-point tensors made without a dtype are of `dtype`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_device(name: str, rank: int) -> torch.device:
    """"auto" -> cuda:<rank mod device count> when CUDA is available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ExplainedError("device 'cuda' was requested but CUDA is not available")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, hf_config: object, device: torch.device) -> torch.dtype:
    """"auto": the checkpoint's 16-bit dtype on GPUs (bfloat16 if it declares none), float32 on CPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    declared = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    declared = getattr(torch, declared) if isinstance(declared, str) else declared
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model(config: EngineConfig, hf_config: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`config.architecture` built on `device` with parameters of `dtype`, its weights loaded from `config.model`
    (`load_weights`, whose errors it raises), in eval mode."""
    with torch.device(device), default_dtype(dtype):
        model = MODEL_REGISTRY[config.architecture](hf_config, config.max_model_len)
    model.to(device)  # buffers built on the host (rope tables)
    load_weights(model, config.model, hf_config)
    return model.eval()


def expected_shape(name: str, hf_config: Any) -> tuple[int, ...] | None:
    """The shape config.json implies for checkpoint tensor `name` (Hugging Face Llama / Qwen3
    names, whole and unsharded); None for a name it does not describe."""
    h, inter, vocab = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    d = head_dim_of(hf_config)
    q = hf_config.num_attention_heads * d
    kv = (getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads) * d
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.bias": (h,),
        "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h), "down_proj.weight": (h, inter),
        "gate_proj.bias": (inter,), "up_proj.bias": (inter,), "down_proj.bias": (h,),
        "q_norm.weight": (d,), "k_norm.weight": (d,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), "norm.weight": (h,),
    }
    return shapes.get(".".join(name.split(".")[-2:]))


def load_weights(model: nn.Module, model_dir: str, hf_config: Any) -> None:
    """Fill every parameter of `model` from `model_dir/*.safetensors`; `hf_config` is the folder's
    config.json as `common.config.load_hf_config` read it.

    Raises `ConfigError` (its message says all: no traceback) when there is no safetensors file, a file
    cannot be read (truncated or corrupt), a tensor's shape is not the one config.json implies, or
    parameters stay unloaded; `KeyError` for a checkpoint tensor with no matching parameter.
    """
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"no *.safetensors file in {model_dir}: the checkpoint's weights are missing")
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for path in files:
        try:
            checkpoint = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise _unreadable(path, exc) from None
        with checkpoint as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                target, shard_id = name, None
                for part, (fused, shard) in packed.items():
                    if f".{part}." in name:
                        target, shard_id = name.replace(f".{part}.", f".{fused}."), shard
                        break
                param = params.get(target)
                if param is None:
                    raise KeyError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
                shape, expected = tuple(f.get_slice(name).get_shape()), expected_shape(name, hf_config)
                if expected is not None and shape != expected:
                    raise ConfigError(
                        f"checkpoint tensor {name} in {os.path.basename(path)} has shape {list(shape)}, but "
                        f"{model_dir}/config.json implies {list(expected)}: its vocab_size, hidden_size, "
                        "intermediate_size or head counts do not describe these weights")
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise _unreadable(path, exc) from None
                loader = getattr(param, "weight_loader", None)
                with torch.no_grad():
                    if loader is None:
                        param.data.copy_(tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                loaded.add(target)
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ConfigError(f"checkpoint {model_dir} lacks weights for {missing[:8]}{'...' if len(missing) > 8 else ''}")


def _unreadable(path: str, exc: Exception) -> ConfigError:
    return ConfigError(f"cannot read the checkpoint file {path}: {exc} (a truncated or corrupt download?)")
