"""Plain-torch attention over the paged KV cache: the CPU path and the reference for kernels.

Loops over sequences in Python and computes in float32; meant for correctness, not speed. An fp8
cache (float8 e4m3fn) is written with `quantize_fp8`, the same bytes the Triton store kernels write.
"""

from __future__ import annotations

import torch

from workers.attention.base import AttentionBackend, AttentionMetadata
from workers.deterministic import attend_per_query, deterministic
from workers.kv_cache import FP8_KV_DTYPE, quantize_fp8


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k/v `[T, Hk, D]` into the caches at `slot_mapping` `[T]`; slots of -1 are skipped. An fp8
    cache gets `e4m3(k / k_scale)` and `e4m3(v / v_scale)`."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    hk, d = k.shape[1], k.shape[2]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype == FP8_KV_DTYPE:  # index_copy_ has no float8 kernel: copy the bytes
            codes = quantize_fp8(x[valid], scale).view(torch.uint8)
            cache.view(torch.uint8).view(-1, hk, d).index_copy_(0, slots, codes)
        else:
            cache.view(-1, hk, d).index_copy_(0, slots, x[valid].to(cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence from a paged cache: `[seq_len, Hk, D]`, in float32
    times `scale` for an fp8 cache, else in the cache's dtype."""
    bs = cache.shape[1]
    num_blocks = -(-seq_len // bs)
    blocks = block_table[:num_blocks].long().to(cache.device)
    context = cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]
    return context.float() * scale if cache.dtype == FP8_KV_DTYPE else context


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
        lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
        out = torch.zeros_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for b in range(len(lens)):
            start, end, seq_len = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
            n = end - start
            if n == 0 or seq_len == 0:
                continue
            keys = gather_context(k_cache, meta.block_tables[b], seq_len, k_scale).float().repeat_interleave(group, 1)
            values = gather_context(v_cache, meta.block_tables[b], seq_len, v_scale).float().repeat_interleave(group, 1)
            if deterministic():  # each query alone: the same arithmetic in any chunk (workers/deterministic.py)
                out[start:end] = attend_per_query(q[start:end], keys, values, scale).to(q.dtype)
                continue
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
            query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            allowed = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [n, seq_len]
            scores.masked_fill_(~allowed, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        return out
