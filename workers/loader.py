"""Load a Hugging Face checkpoint's *.safetensors into a model, shard by shard.

Each checkpoint tensor is routed to a parameter; names listed in the model's
`packed_modules_mapping` (q_proj -> qkv_proj shard "q", gate_proj -> gate_up_proj shard 0, ...)
go to the fused parameter's loader with their shard id. Parameters' own `weight_loader`s cut
out this rank's slice, so tensor parallelism needs nothing here.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Fill every parameter of `model` from `model_dir/*.safetensors`.

    Raises `FileNotFoundError` when there is no safetensors file, `KeyError` for a checkpoint
    tensor with no matching parameter, and `ValueError` when parameters stay unloaded.
    """
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
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
                tensor = f.get_tensor(name)
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
        raise ValueError(f"checkpoint {model_dir} lacks weights for {missing[:8]}{'...' if len(missing) > 8 else ''}")
