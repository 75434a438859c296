"""Write a checkpoint with the exact shape of Qwen3-0.6B or Qwen3-8B and random bf16 weights.

Throughput does not depend on weight values, so benchmarks use these instead of downloads.

    python benchmarks/make_checkpoint.py --shape qwen3-0.6b --tokenizer TOKENIZER_DIR --out DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

SHAPES = {
    # hidden, layers, q heads, kv heads, head_dim, intermediate, vocab 151936, rope_theta 1e6
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
}


def make_checkpoint(shape: str, out: str, tokenizer_dir: str | None, device: str = "cpu", seed: int = 0) -> None:
    cfg = Qwen3Config(vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      bos_token_id=151643, eos_token_id=151645, **SHAPES[shape])
    cfg.architectures = ["Qwen3ForCausalLM"]
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape_: int) -> torch.Tensor:
        return (torch.randn(*shape_, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    os.makedirs(out, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(cfg.vocab_size, h),
                                        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(cfg.vocab_size, h)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(nq * d, h), p + "self_attn.k_proj.weight": rand(nkv * d, h),
            p + "self_attn.v_proj.weight": rand(nkv * d, h), p + "self_attn.o_proj.weight": rand(h, nq * d),
            p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            if name.endswith((".json", ".txt", ".jinja")) and name != "config.json":
                shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=None, help="folder with the Qwen3 tokenizer files to copy in")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    t0 = time.perf_counter()
    make_checkpoint(args.shape, args.out, args.tokenizer, args.device)
    print(f"wrote {args.shape} to {args.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
