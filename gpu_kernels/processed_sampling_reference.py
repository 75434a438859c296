"""The semantics of gpu_kernels/processed_sampling.py in plain numpy, one row at a time: the definition the
kernels are tested against. Deliberately simple: a full sort per row, float64 masses, the noise from a numpy
Philox4x32-10 (Salmon et al., SC 2011) with Triton's word-to-uniform mapping.

The processed logits y are computed with the kernels' float32 operations in the kernels' order (numpy float32
arithmetic is IEEE, as the Triton interpreter's is), so they agree bit for bit with the interpreted kernels; on
a GPU, FMA contraction and the hardware exp/log move some values by an ulp.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_kernels.sampling_inputs import (
    BAN_ALWAYS,
    F_FREQUENCY,
    F_INV_REPETITION,
    F_INV_TEMPERATURE,
    F_MIN_P,
    F_PRESENCE,
    F_REPETITION,
    F_TEMPERATURE,
    F_TOP_P,
    I_GRAMMAR_ROW,
    I_NUM_LOGPROBS,
    I_SCRATCH_ROW,
    I_STATE_ROW,
    I_TOP_K,
    PenaltyBits,
    ProcessedParams,
    SparseEntries,
)

_M32 = 0xFFFF_FFFF
_FLT_MAX = np.float32(3.4028234663852886e38)


def philox_words(counters: np.ndarray, seeds: int | np.ndarray) -> np.ndarray:
    """Philox4x32-10 of the counters (c, 0, 0, 0) under the keys (seed low word, seed high word): the four
    words Triton's `tl.randint4x(seed, c)` returns, `[4, *seeds.shape, len(counters)]` uint32."""
    seeds = np.asarray(seeds, dtype=np.uint64)[..., None]
    c = [np.broadcast_to(counters.astype(np.uint64), np.broadcast_shapes(seeds.shape, counters.shape))]
    c += [np.zeros_like(c[0]) for _ in range(3)]
    m32 = np.uint64(_M32)
    k0, k1 = seeds & m32, (seeds >> np.uint64(32)) & m32
    for _ in range(10):
        p0, p1 = np.uint64(0xCD9E8D57) * c[2], np.uint64(0xD2511F53) * c[0]
        c = [(p0 >> np.uint64(32)) ^ c[1] ^ k0, p0 & m32, (p1 >> np.uint64(32)) ^ c[3] ^ k1, p1 & m32]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    return np.stack(c).astype(np.uint32)


def gumbel_log_terms(vocab_size: int, seeds: int | np.ndarray) -> np.ndarray:
    """`[*seeds.shape, vocab]` float32 log(-log(u_i)), u_i the uniform of entry i (word i % 4 of counter i // 4,
    as tl.uint_to_uniform_float maps it), clamped at 1e-20: the Gumbel score of entry i is y_i minus this."""
    words = philox_words(np.arange(-(-vocab_size // 4)), seeds)  # [4, *seeds.shape, counters]
    by_entry = np.moveaxis(words, 0, -1)  # [..., counters, 4]: entry 4c + w is word w of counter c
    bits = by_entry.reshape(*by_entry.shape[:-2], -1)[..., :vocab_size].view(np.int32)
    u = np.where(bits < 0, ~bits, bits).astype(np.float32) * np.float32(4.6566127342e-10)
    return np.log(-np.log(np.maximum(u, np.float32(1e-20))))


@dataclass
class ReferenceSample:
    """numpy counterparts of ProcessedSample, plus the processed logits and each row's kept set."""

    tokens: np.ndarray  # [n] int64
    logprobs: np.ndarray  # [n] float64
    ranks: np.ndarray  # [n] int64
    top_logprobs: np.ndarray  # [n, num_top] float64
    top_ids: np.ndarray  # [n, num_top] int64
    y: np.ndarray  # [n, V] float32: the processed logits
    kept: np.ndarray  # [n, V] bool


def processed_logits(logits: torch.Tensor, params: ProcessedParams, *, penalties: PenaltyBits | None = None,
                     bitmask: torch.Tensor | None = None, sparse: SparseEntries | None = None,
                     last_sampled: torch.Tensor | None = None) -> np.ndarray:
    """Steps 1-5 of the processed sampler: `[n, V]` float32 y (NaN -> -inf, +inf -> the largest float)."""
    x = logits.float().cpu().numpy().copy()
    n, vocab = x.shape
    f, i = params.floats.cpu().numpy(), params.ints.cpu().numpy()
    bits = _unpack(bitmask, vocab) if bitmask is not None else None
    if penalties is not None:
        seen_t, output_t, counts_t = penalties.tensors()
        seen, generated, counts = _unpack(seen_t, vocab), _unpack(output_t, vocab), counts_t.cpu().numpy()
    last = last_sampled.cpu().numpy() if last_sampled is not None else None
    y = np.empty_like(x)
    for r in range(n):
        row = x[r]
        if i[r, I_GRAMMAR_ROW] >= 0:
            row = np.where(bits[i[r, I_GRAMMAR_ROW]], row, -np.inf).astype(np.float32)
        bias = np.zeros(vocab, np.float32)
        banned = np.zeros(vocab, bool)
        if sparse is not None and i[r, I_SCRATCH_ROW] >= 0:
            lo, hi = sparse.offsets[r].item(), sparse.offsets[r + 1].item()
            tok = sparse.tokens[lo:hi].cpu().numpy()
            bias[tok] = sparse.bias[lo:hi].cpu().numpy()
            after = sparse.ban_after[lo:hi].cpu().numpy()
            state = i[r, I_STATE_ROW]
            last_token = last[state] if last is not None and state >= 0 else -3
            banned[tok[(after == BAN_ALWAYS) | ((after >= 0) & (after == last_token))]] = True
        row = row + bias
        row = np.where(banned, -np.inf, row).astype(np.float32)
        state = i[r, I_STATE_ROW]
        if state >= 0 and f[r, F_REPETITION] != 1:
            positive = row > 0
            scaled = np.where(positive, row * f[r, F_INV_REPETITION], row * f[r, F_REPETITION])
            row = np.where(seen[state], scaled, row).astype(np.float32)
        if state >= 0 and (f[r, F_FREQUENCY] != 0 or f[r, F_PRESENCE] != 0):
            c = np.where(generated[state], counts[state], 0).astype(np.float32)
            row = (row - f[r, F_FREQUENCY] * c - f[r, F_PRESENCE] * (c > 0).astype(np.float32)).astype(np.float32)
        row = row * f[r, F_INV_TEMPERATURE]
        y[r] = np.minimum(np.where(np.isnan(row), -np.inf, row), _FLT_MAX)
    return y


def reference_processed_sample(logits: torch.Tensor, params: ProcessedParams, seeds: torch.Tensor, *,
                               penalties: PenaltyBits | None = None, bitmask: torch.Tensor | None = None,
                               sparse: SparseEntries | None = None, last_sampled: torch.Tensor | None = None,
                               num_top: int = 0) -> ReferenceSample:
    """What `processed_sample` must return for the same arguments (see its module docstring)."""
    y = processed_logits(logits, params, penalties=penalties, bitmask=bitmask, sparse=sparse,
                         last_sampled=last_sampled)
    n, vocab = y.shape
    f, i = params.floats.cpu().numpy(), params.ints.cpu().numpy()
    seeds_host = seeds.cpu().numpy()
    out = ReferenceSample(np.zeros(n, np.int64), np.zeros(n), np.zeros(n, np.int64), np.full((n, num_top), -np.inf),
                          np.zeros((n, num_top), np.int64), y, np.zeros((n, vocab), bool))
    for r in range(n):
        kept = _kept(y[r], f[r, F_TEMPERATURE], i[r, I_TOP_K], f[r, F_TOP_P], f[r, F_MIN_P])
        out.kept[r] = kept
        if not kept.any():
            token = 0
        elif f[r, F_TEMPERATURE] <= 0:
            token = int(np.argmax(np.where(kept, y[r], -np.inf)))
        else:
            score = y[r] - gumbel_log_terms(vocab, int(seeds_host[r]))
            token = int(np.argmax(np.where(kept, score, -np.inf)))  # the first maximum
        out.tokens[r] = token
        asked = i[r, I_NUM_LOGPROBS]
        listed: list[int] = []
        if asked >= 0:
            if kept.any():
                lse = _logsumexp(y[r][kept])
                out.logprobs[r] = y[r, token] - lse
                out.ranks[r] = 1 + int((kept & (y[r] > y[r, token])).sum())
                ids = np.flatnonzero(kept)
                order = ids[np.lexsort((ids, -y[r][ids].astype(np.float64)))]  # value descending, then id
                listed = order[: min(asked, num_top)].tolist()
                out.top_logprobs[r, : len(listed)] = y[r, listed] - lse
            else:
                out.logprobs[r], out.ranks[r] = -np.inf, 1
        free = (t for t in range(vocab + num_top) if t not in set(listed))
        out.top_ids[r] = listed + [next(free) for _ in range(num_top - len(listed))]
    return out


def _kept(y: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept set of one row: top-k (ties kept), then top-p over it, then min-p; none for greedy rows."""
    finite = y > -np.inf
    if temperature <= 0 or not finite.any():
        return finite
    values = np.sort(y[finite])[::-1]
    row_max = values[0]
    tau_k = values[top_k - 1] if 0 < top_k < len(values) else -np.inf
    tau_p = -np.inf
    if top_p < 1:
        # workers/logits_processing.py's rule: a token stays if the mass of the top-k tokens sorted before it
        # is below p times the top-k mass; the threshold is the last such token's value.
        candidates = values[values >= tau_k]
        w = np.exp(candidates.astype(np.float64) - np.float64(row_max))
        before = np.cumsum(w) - w
        last = max(int((before < np.float64(top_p) * w.sum()).sum()) - 1, 0)
        tau_p = candidates[last]
    tau_min = np.float32(np.float64(row_max) + np.log(np.float64(min_p))) if min_p > 0 else -np.inf
    return finite & (y >= max(tau_k, tau_p, tau_min))


def _logsumexp(v: np.ndarray) -> float:
    top = np.float64(v.max())
    return float(top + np.log(np.exp(v.astype(np.float64) - top).sum()))


def _unpack(words: torch.Tensor, vocab: int) -> np.ndarray:
    """`[rows, V]` bool from `[rows, ceil(V / 32)]` int32 words (bit t % 32 of word t // 32)."""
    w = words.cpu().numpy().view(np.uint32)
    bits = (w[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(w.shape[0], -1)[:, :vocab].astype(bool)
