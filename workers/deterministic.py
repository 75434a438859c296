"""Deterministic mode (`--deterministic`, `LLM(..., deterministic=True)`): a request's logits at every position are
bitwise the same whatever else is in its batch.

Why they are not by default (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025): the kernels
reduce in an order that depends on the batch. On a CPU, BLAS picks a different GEMM kernel for a different number
of rows (fp32 `F.linear`: row 0 of a batch of 1, of 2-3 and of 4 or more rows differ in the last bits), and the
torch attention backend multiplies a chunk's queries together, so a token computed in a prefill chunk of 7
tokens, in one of 64 or in a decode step gets different roundings. One differing bit in a hidden state grows
along the layers and can flip a greedy token many steps later.

The mode swaps those kernels for ones whose per-row result cannot depend on the other rows:
- every linear layer and the LM head: `gpu_kernels.batch_invariant.matmul_batch_invariant` (on a CPU, fixed
  chunks of `CPU_CHUNK_ROWS` zero-padded rows, so BLAS always sees one shape);
- RMSNorm (with its residual add, and the QK-norm): `rms_norm_batch_invariant`;
- attention on the CPU: `attend_per_query` below, each query token alone against exactly the keys it sees, so its
  arithmetic is the same in a prefill chunk of any size, in decode, after a prefix-cache hit or a recompute;
- the floating-point reductions over the vocabulary (the logsumexp of logprobs, top-p's probability mass): one
  call per row on a CPU (`row_reduce`);
- the rest is per row already: embedding, RoPE, SiLU-and-mul, the sampler's Gumbel-max draw (one per row from the
  row's own seed; an argmax is exact in any order), top-k, sorts, counts.
The KV cache is written once per token, in the model's dtype, by the same code whatever the step.

On a GPU the default kernels vary too: the decode attention kernel picks its split-KV count from the batch,
cuBLAS its tiles from M, CUDA graphs pad batches, and the fused kernels (torch.compile'd RMSNorm, QK-norm + RoPE +
KV store, the small-batch GEMV) have their own reductions. The mode's GPU path: the persistent Triton matmul and
the per-row RMSNorm kernel of `gpu_kernels/batch_invariant.py`, the batch-invariant fused QK-norm + RoPE + KV
store, and every query token (prefill and decode rows, CUDA graphs included) through
`gpu_kernels/deterministic_attention.py`, whose splits of a fixed size in tokens are folded in one order, in place
or split-parallel for a small decode step (tests/test_gpu_deterministic.py checks the bits on a GPU). The switch is
process-wide (each worker sets it once at start-up, like `workers.layers.fused.enable_compilation`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_enabled = False


def set_deterministic(enabled: bool) -> None:
    """Set once by the model runner, before the model runs: batch-invariant kernels on or off."""
    global _enabled
    _enabled = bool(enabled)


def deterministic() -> bool:
    """Whether this process runs the batch-invariant kernels (`set_deterministic`)."""
    return _enabled


def sampling_chunk_size(vocab: int, tile_size: int, device: torch.device) -> int | None:
    """The vocabulary chunk of the fused processed sampler (`gpu_kernels.processed_sampling.processed_sample`)
    in deterministic mode on a GPU; None (the sampler's own choice) elsewhere. The sampler picks smaller chunks for
    fewer rows, to fill the SMs, and its float sums over a row's chunks (the top-p masses, the kept mass of a
    logprob row) then add in another grouping: a logprob moved with the batch size. Fixed here at the choice for
    one row, which every batch size then uses (more programs per pass at large batches)."""
    if not (_enabled and device.type == "cuda"):
        return None
    from gpu_kernels.processed_sampling import choose_processed_chunk_size

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_processed_chunk_size(1, vocab, sms, tile_size)


def row_reduce(x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`reduce(x)` for a reduction over the last dimension of `x` `[R, V]` (e.g. `torch.logsumexp(t, dim=-1)`),
    returning `[R]`. In deterministic mode on a CPU each row is reduced by its own call: torch's CPU reductions
    split the rows of a batch over their threads differently for different R (a logsumexp over a 151,669-token
    row gave 19.469633 among two rows and 19.469635 alone). Elsewhere one call for the batch."""
    if not (_enabled and x.device.type == "cpu") or x.shape[0] == 0:
        return reduce(x)
    return torch.stack([reduce(row.unsqueeze(0))[0] for row in x])


def attend_per_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's last `n` query tokens, each computed on its own.

    q `[n, Hq, D]`; keys and values `[L, Hq, D]` float32 (the sequence's whole context, its KV heads repeated for
    the query heads), L >= n; query i sits at position `L - n + i` and sees keys `0 .. L - n + i`. Returns `[n, Hq,
    D]` float32. Each query is one `[Hq, 1, D] x [Hq, D, k]` product and one `[Hq, 1, k] x [Hq, k, D]` product over
    exactly its k visible keys, so its result depends only on its own position and context: the same whether it is
    computed alone (decode), in a prefill chunk of any size, or again after a preemption.
    """
    n, seq_len = q.shape[0], keys.shape[0]
    k_t = keys.permute(1, 2, 0)  # [Hq, D, L]
    v_h = values.permute(1, 0, 2)  # [Hq, L, D]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(n):
        visible = seq_len - n + i + 1
        scores = torch.bmm(q[i].float().unsqueeze(1), k_t[:, :, :visible]) * scale  # [Hq, 1, k]
        out[i] = torch.bmm(scores.softmax(-1), v_h[:, :visible]).squeeze(1)
    return out
