"""The draw kernels of the processed-row sampler, after the threshold search: sample (Gumbel-max or argmax over
the kept set, per chunk), rank (each row's token from the chunk winners, and its rank among the kept entries)
and finish (logprob, rank and top-N logprobs). The search kernels are in gpu_kernels/processed_sampling_kernels.py,
the design and entry point in gpu_kernels/processed_sampling.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu_kernels.pdl import wait_then_release
from gpu_kernels.processed_sampling_device import (
    _NI,
    _R_KEPT_MASS,
    _R_MAX,
    _R_TAU,
    _R_Y_TOKEN,
    _SW,
    _chunk_tiles,
    _load_y,
    _nth_tile,
    _row,
    _row_pointers,
)
from gpu_kernels.sampling import _chunk_best


@triton.jit
def _sample_block(base, Q: tl.constexpr, src, logits_row, scratch_row_ptr, grammar_row_ptr, has_grammar, seen_row_ptr,
                  has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t, vocab_size, tau,
                  sampled, seed, logprobs, row_max, best_score, best_index, best_y, kept_mass):
    """Gumbel-max (or argmax) lanes over entries base .. base + 4Q - 1 ([Q, 4]: row q holds the four entries of
    Philox counter base / 4 + q, as in gpu_kernels/sampling.py) of the kept set {y >= tau}."""
    quads = tl.arange(0, Q)
    words = tl.arange(0, 4)
    cols = base + 4 * quads[:, None] + words[None, :]
    mask = cols < vocab_size
    y = _load_y(src, logits_row, scratch_row_ptr, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep,
                rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t)
    kept = mask & (y > -float("inf")) & (y >= tau)
    if sampled != 0:
        r0, r1, r2, r3 = tl.randint4x(seed, base // 4 + quads)
        bits = tl.where(words[None, :] == 0, r0[:, None],
                        tl.where(words[None, :] == 1, r1[:, None],
                                 tl.where(words[None, :] == 2, r2[:, None], r3[:, None])))
        u = tl.uint_to_uniform_float(bits)
        score = y - tl.log(-tl.log(tl.maximum(u, 1e-20)))
    else:
        score = y
    better = kept & (score > best_score)  # strictly: the first index wins a tie; NaN is -inf already
    best_index = tl.where(better, cols, best_index)
    best_score = tl.where(better, score, best_score)
    best_y = tl.where(better, y, best_y)
    if logprobs != 0:
        kept_mass += tl.where(kept, tl.exp(y - row_max), 0.0)
    return best_score, best_index, best_y, kept_mass


@triton.jit
def _lane_winner(best_score, best_index, best_y, kept_mass, vocab_size):
    """The chunk's (score, lowest index among the best, its y, kept mass) from the lanes."""
    top = tl.max(tl.max(best_score, axis=1), axis=0)
    index = tl.min(tl.min(tl.where(best_score == top, best_index, vocab_size), axis=1), axis=0)
    y_index = tl.max(tl.max(tl.where(best_index == index, best_y, -float("inf")), axis=1), axis=0)
    return top, index, y_index, tl.sum(tl.sum(kept_mass, axis=1), axis=0)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, fparams_ptr, iparams_ptr, seeds_ptr, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr,
    counts_ptr, tile_max_ptr, row_ptr, best_score_ptr, best_index_ptr, best_y_ptr, kept_mass_ptr,
    num_chunks, vocab_size, num_words, num_tiles,
    CHUNK: tl.constexpr, TILE: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    chunk = tl.program_id(1)
    (temperature, inv_t, top_p, min_p, rep, inv_rep, freq, pres, top_k, state_row, grammar_row, scratch_row,
     num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar, src, stats, logprobs,
     plain) = _row(fparams_ptr, iparams_ptr, row)
    logits_row = logits_ptr + row * stride_row
    out = row * num_chunks + chunk
    if plain != 0:
        # Exactly gpu_kernels/sampling.py's stage one (the same function, arguments and noise).
        if temperature == 0.0:
            top, index = _chunk_best(logits_row, 0, 1.0, vocab_size, 0, chunk * CHUNK, CHUNK, BLOCK_V, 0, False)
        else:
            seed = tl.load(seeds_ptr + row)
            top, index = _chunk_best(logits_row, seed, 1.0 / temperature, vocab_size, 0, chunk * CHUNK, CHUNK,
                                     BLOCK_V, 0, True)
        tl.store(best_score_ptr + out, top)
        tl.store(best_index_ptr + out, index)
        tl.store(best_y_ptr + out, -float("inf"))
        tl.store(kept_mass_ptr + out, 0.0)
    else:
        tau = tl.load(row_ptr + row * _SW + _R_TAU, mask=stats != 0, other=-float("inf"))
        row_max = tl.load(row_ptr + row * _SW + _R_MAX, mask=stats != 0, other=0.0)
        seed = tl.load(seeds_ptr + row)
        logits_row, scratch_row_ptr, grammar_row_ptr, seen_row_ptr, output_row_ptr, counts_row_ptr = (
            _row_pointers(logits_ptr, stride_row, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr, row,
                          scratch_row, grammar_row, state_row, vocab_size, num_words))
        # Dense (large blocks over the whole chunk) when the tile statistics would skip little, or do not exist.
        maxima, hit, n_hit, rank = _chunk_tiles(tile_max_ptr, row, chunk, num_tiles, tau, 0, CHUNK // TILE)
        if (stats == 0) | (n_hit * 4 > CHUNK // TILE):
            # The lanes of each branch have their own names: compiled Triton merges a name bound in both branches
            # of an `if`, and these differ in shape ([BLOCK_V // 4, 4] here, [TILE // 4, 4] below).
            d_score = tl.full([BLOCK_V // 4, 4], -float("inf"), tl.float32)
            d_index = tl.full([BLOCK_V // 4, 4], vocab_size, tl.int32)
            d_y = tl.full([BLOCK_V // 4, 4], -float("inf"), tl.float32)
            d_mass = tl.zeros([BLOCK_V // 4, 4], tl.float32)
            for start in range(0, CHUNK, BLOCK_V):
                d_score, d_index, d_y, d_mass = _sample_block(
                    chunk * CHUNK + start, BLOCK_V // 4, src, logits_row, scratch_row_ptr, grammar_row_ptr,
                    has_grammar, seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq,
                    pres, inv_t, vocab_size, tau, sampled, seed, logprobs, row_max, d_score, d_index, d_y, d_mass)
            top, index, y_index, mass = _lane_winner(d_score, d_index, d_y, d_mass, vocab_size)
        else:
            t_score = tl.full([TILE // 4, 4], -float("inf"), tl.float32)
            t_index = tl.full([TILE // 4, 4], vocab_size, tl.int32)
            t_y = tl.full([TILE // 4, 4], -float("inf"), tl.float32)
            t_mass = tl.zeros([TILE // 4, 4], tl.float32)
            for i in range(0, n_hit):
                tile, tile_max = _nth_tile(maxima, hit, rank, i, chunk, CHUNK // TILE)
                t_score, t_index, t_y, t_mass = _sample_block(
                    tile * TILE, TILE // 4, src, logits_row, scratch_row_ptr, grammar_row_ptr, has_grammar,
                    seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres,
                    inv_t, vocab_size, tau, sampled, seed, logprobs, row_max, t_score, t_index, t_y, t_mass)
            top, index, y_index, mass = _lane_winner(t_score, t_index, t_y, t_mass, vocab_size)
        tl.store(best_score_ptr + out, top)
        tl.store(best_index_ptr + out, index)
        tl.store(best_y_ptr + out, y_index)
        tl.store(kept_mass_ptr + out, mass)


@triton.jit
def _count_above(start, BLOCK: tl.constexpr, src, logits_row, scratch_row_ptr, grammar_row_ptr, has_grammar,
                 seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t,
                 vocab_size, bound):
    cols = start + tl.arange(0, BLOCK)
    y = _load_y(src, logits_row, scratch_row_ptr, cols, cols < vocab_size, grammar_row_ptr, has_grammar, seen_row_ptr,
                has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t)
    return tl.sum((y > bound).to(tl.int32), axis=0)


@triton.jit
def _rank_kernel(
    logits_ptr, stride_row, fparams_ptr, iparams_ptr, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr,
    tile_max_ptr, row_ptr, best_score_ptr, best_index_ptr, best_y_ptr, kept_mass_ptr, rank_ptr, tokens_ptr,
    num_chunks, vocab_size, num_words, num_tiles,
    CHUNK: tl.constexpr, TILE: tl.constexpr, CH: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    chunk = tl.program_id(1)
    (temperature, inv_t, top_p, min_p, rep, inv_rep, freq, pres, top_k, state_row, grammar_row, scratch_row,
     num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar, src, stats, logprobs,
     plain) = _row(fparams_ptr, iparams_ptr, row)
    c = tl.arange(0, CH)
    cm = c < num_chunks
    scores = tl.load(best_score_ptr + row * num_chunks + c, mask=cm, other=-float("inf"))
    indices = tl.load(best_index_ptr + row * num_chunks + c, mask=cm, other=vocab_size)
    top = tl.max(scores, axis=0)
    # Chunk c holds lower indices than chunk c + 1: the lowest index among the best is the row's first best.
    index = tl.min(tl.where(scores == top, indices, vocab_size), axis=0)
    if chunk == 0:
        tl.store(tokens_ptr + row, tl.where(index < vocab_size, index, 0).to(tl.int64))
    if logprobs != 0:
        y_token = tl.max(tl.load(best_y_ptr + row * num_chunks + c, mask=cm & (indices == index),
                                 other=-float("inf")), axis=0)
        if chunk == 0:
            tl.store(row_ptr + row * _SW + _R_Y_TOKEN, y_token)
            tl.store(row_ptr + row * _SW + _R_KEPT_MASS,
                     tl.sum(tl.load(kept_mass_ptr + row * num_chunks + c, mask=cm, other=0.0), axis=0))
        above = index * 0  # an int32 tensor: a loop-carried value must keep its type
        if index < vocab_size:  # the token is kept, so every entry above it is kept too
            logits_row, scratch_row_ptr, grammar_row_ptr, seen_row_ptr, output_row_ptr, counts_row_ptr = (
                _row_pointers(logits_ptr, stride_row, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr, row,
                              scratch_row, grammar_row, state_row, vocab_size, num_words))
            maxima, hit, n_hit, rank = _chunk_tiles(tile_max_ptr, row, chunk, num_tiles, y_token, 1, CHUNK // TILE)
            if n_hit * 4 > CHUNK // TILE:
                for start in range(0, CHUNK, BLOCK_V):
                    above += _count_above(chunk * CHUNK + start, BLOCK_V, src, logits_row, scratch_row_ptr,
                                          grammar_row_ptr, has_grammar, seen_row_ptr, has_rep, rep, inv_rep,
                                          output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t, vocab_size,
                                          y_token)
            else:
                for i in range(0, n_hit):
                    tile, tile_max = _nth_tile(maxima, hit, rank, i, chunk, CHUNK // TILE)
                    above += _count_above(tile * TILE, TILE, src, logits_row, scratch_row_ptr, grammar_row_ptr,
                                          has_grammar, seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr,
                                          counts_row_ptr, has_fp, freq, pres, inv_t, vocab_size, y_token)
        tl.store(rank_ptr + row * num_chunks + chunk, above)


@triton.jit(do_not_specialize=["num_top"])  # one compiled variant for every width the rows ask for (0..MAX_TOP)
def _finish_kernel(
    iparams_ptr, row_ptr, rank_ptr, top_v_ptr, top_id_ptr, flags_ptr, overflow_ptr,
    logprob_ptr, rank_out_ptr, top_logprob_ptr, top_ids_ptr, threshold_ptr, flags_out_ptr, num_chunks, num_top,
    CH: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    num_logprobs = tl.load(iparams_ptr + row * _NI + 4)
    asks = num_logprobs >= 0
    r = row_ptr + row * _SW
    y_token = tl.load(r + _R_Y_TOKEN, mask=asks, other=-float("inf"))
    row_max = tl.load(r + _R_MAX, mask=asks, other=0.0)
    kept_mass = tl.load(r + _R_KEPT_MASS, mask=asks, other=1.0)
    # A row with no finite logit keeps nothing: its logprobs are -inf whatever lse is (kept finite here).
    lse = tl.where(kept_mass > 0, row_max, 0.0) + tl.log(tl.where(kept_mass > 0, kept_mass, 1.0))
    logprob = tl.where(asks, tl.where(y_token > -float("inf"), y_token - lse, -float("inf")), 0.0)
    c = tl.arange(0, CH)
    above = tl.load(rank_ptr + row * num_chunks + c, mask=tl.where(asks, c < num_chunks, False), other=0)
    above = tl.sum(above, axis=0)
    rank = tl.where(asks, 1 + above, 0)
    s = tl.arange(0, NB)
    listed = asks & (num_logprobs > 0)
    listed_mask = tl.where(listed, s < NB, False)
    listed_id = tl.load(top_id_ptr + row * NB + s, mask=listed_mask, other=-1)
    listed_v = tl.load(top_v_ptr + row * NB + s, mask=listed_mask, other=-float("inf")) - lse
    # Slots past the kept entries (a prefix): -inf and the lowest ids not listed before them.
    used = listed_id >= 0
    cand = tl.arange(0, 2 * NB)
    free = tl.sum((listed_id[None, :] == cand[:, None]).to(tl.int32), axis=1) == 0
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    want = s - tl.sum(used.to(tl.int32), axis=0)
    fill = tl.sum(tl.where((free_rank[None, :] == want[:, None]) & free[None, :], cand[None, :], 0), axis=1)
    tl.store(logprob_ptr + row, logprob)
    tl.store(rank_out_ptr + row, rank.to(tl.int64))
    tl.store(top_logprob_ptr + row * num_top + s, tl.where(used, listed_v, -float("inf")), mask=s < num_top)
    tl.store(top_ids_ptr + row * num_top + s, tl.where(used, listed_id, fill).to(tl.int64), mask=s < num_top)
    tl.store(threshold_ptr + row, tl.load(r + _R_TAU))
    flags = tl.load(flags_ptr + row)
    tl.store(flags_out_ptr + row, flags)
    if flags != 0:
        tl.atomic_add(overflow_ptr, 1)
