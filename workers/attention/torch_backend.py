"""Plain-torch attention over the paged KV cache: the CPU path and the reference for kernels.

Loops over sequences in Python and computes in float32; meant for correctness, not speed.
"""

from __future__ import annotations

import torch

from workers.attention.base import AttentionBackend, AttentionMetadata


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write k/v `[T, Hk, D]` into the caches at `slot_mapping` `[T]`; slots of -1 are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    hk, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hk, d).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, hk, d).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence from a paged cache: `[seq_len, Hk, D]`."""
    bs = cache.shape[1]
    num_blocks = -(-seq_len // bs)
    blocks = block_table[:num_blocks].long().to(cache.device)
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
        lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
        out = torch.zeros_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for b in range(len(lens)):
            start, end, seq_len = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
            n = end - start
            if n == 0 or seq_len == 0:
                continue
            keys = gather_context(k_cache, meta.block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
            values = gather_context(v_cache, meta.block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
            query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            allowed = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [n, seq_len]
            scores.masked_fill_(~allowed, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        return out
