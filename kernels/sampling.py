"""Fused sampling: one pass over each row of logits picks its token (greedy or Gumbel-max).

For a row with temperature T > 0 the token is `argmax_i(logit_i / T + G_i)` with G_i standard
Gumbel noise, which samples softmax(logits / T) exactly (the Gumbel-max trick: Gumbel 1954;
Maddison, Tarlow & Minka 2014). The noise comes from Triton's counter-based Philox generator
keyed by a per-row seed and the vocabulary index, so no noise tensor is ever written: the
logits are read once, in their own dtype. A row with T == 0 takes the plain argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperatures_ptr,
    seeds_ptr,
    out_ptr,
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    noise_scale = tl.where(greedy, 0.0, 1.0)
    # Each lane keeps the best score it has seen and where; lanes are reduced once at the end.
    best_score = tl.full([BLOCK_V], -float("inf"), tl.float32)
    best_index = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        logits = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        u = tl.rand(seed, cols)  # uniform in [0, 1)
        gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        score = logits * inv_t + gumbel * noise_scale
        better = mask & (score > best_score)  # strictly greater: the first index wins a tie; NaN never wins
        best_index = tl.where(better, cols, best_index)
        best_score = tl.where(better, score, best_score)
    top = tl.max(best_score, axis=0)
    token = tl.min(tl.where(best_score == top, best_index, vocab_size), axis=0)  # lowest index among the best
    tl.store(out_ptr + row, tl.where(token < vocab_size, token, 0).to(tl.int64))


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: `[n, vocab]` float (bf16, fp16 or fp32), last-dimension stride 1.
        temperatures: `[n]` float32; 0 selects the argmax (greedy), > 0 samples softmax(logits / T).
        seeds: `[n]` int64 Philox seeds; the same (seed, logits) always gives the same token.

    Returns:
        `[n]` int64 token ids. A row whose logits are all -inf or NaN returns 0.

    Raises:
        ValueError: on mismatched shapes or a non-contiguous vocabulary dimension.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [n, vocab] with a contiguous vocabulary dimension")
    n, vocab = logits.shape
    if temperatures.shape != (n,) or seeds.shape != (n,):
        raise ValueError(f"temperatures and seeds must be [{n}], got {tuple(temperatures.shape)}, {tuple(seeds.shape)}")
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _sample_kernel[(n,)](logits, logits.stride(0), temperatures, seeds, out, vocab, BLOCK_V=4096, num_warps=8)
    return out
