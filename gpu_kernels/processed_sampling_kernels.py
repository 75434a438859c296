"""The threshold-search kernels of the processed-row sampler, in launch order: prepare (processed logits and
tile statistics), plan (the row's max, mass and first brackets), pivot (one narrowing pass), collect (a ready
bracket's entries) and resolve (each row's exact threshold and top-N). The draw that follows is in
gpu_kernels/processed_sampling_draw.py, the helpers in gpu_kernels/processed_sampling_device.py, the design and
entry point in gpu_kernels/processed_sampling.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu_kernels.pdl import wait_then_release
from gpu_kernels.processed_sampling_device import (
    _CLIPPED,
    _COUNT,
    _COUNT_THEN_MASS,
    _EXACT,
    _MASS,
    _NONE,
    _PV,
    _R_FINITE,
    _R_MASS,
    _R_MAX,
    _R_MIN,
    _R_TAU,
    _R_TAU_MIN,
    _READY,
    _READY_UPPER,
    _ROUNDED,
    _SEARCH,
    _SEG1,
    _SW,
    _active_tile_raw,
    _adjacent,
    _chunk_tiles,
    _first,
    _first_int,
    _from_order_key,
    _from_raw,
    _load_raw,
    _load_search,
    _order_key,
    _pick,
    _pipeline,
    _pivots,
    _row,
    _row_pointers,
    _step_searches,
    _store_search,
)


@triton.jit(do_not_specialize=["has_last"])  # one compiled variant whatever the value
def _prepare_kernel(
    logits_ptr, stride_row, fparams_ptr, iparams_ptr, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr,
    offsets_ptr, entry_tokens_ptr, entry_bias_ptr, entry_ban_ptr, last_ptr, has_last,
    tile_max_ptr, tile_min_ptr, tile_sum_ptr, tile_cnt_ptr, vocab_size, num_words, num_tiles,
    CHUNK: tl.constexpr, TILE: tl.constexpr, TPB: tl.constexpr, EB: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    chunk = tl.program_id(1)
    (temperature, inv_t, top_p, min_p, rep, inv_rep, freq, pres, top_k, state_row, grammar_row, scratch_row,
     num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar, src, stats, logprobs,
     plain) = _row(fparams_ptr, iparams_ptr, row)
    logits_row, scratch_row_ptr, grammar_row_ptr, seen_row_ptr, output_row_ptr, counts_row_ptr = (
        _row_pointers(logits_ptr, stride_row, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr, row,
                      scratch_row, grammar_row, state_row, vocab_size, num_words))
    chunk_lo = chunk * CHUNK
    if src == 2:
        # The dense pipeline without the sparse entries, then those entries' tokens again from their raw
        # logits with the bias added where step 2 puts it, then the bans. Barriers order the three writers.
        for start in range(0, CHUNK, TILE * TPB):
            cols = chunk_lo + start + tl.arange(0, TILE * TPB)
            mask = cols < vocab_size
            x = tl.load(logits_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            y = _pipeline(x, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep, rep, inv_rep,
                          output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t, 0.0)
            tl.store(scratch_row_ptr + cols, y, mask=mask)
        tl.debug_barrier()
        e0 = tl.load(offsets_ptr + row)
        e1 = tl.load(offsets_ptr + row + 1)
        for e in range(e0, e1, EB):
            idx = e + tl.arange(0, EB)
            em = idx < e1
            tok = tl.load(entry_tokens_ptr + idx, mask=em, other=0)
            mine = em & (tok >= chunk_lo) & (tok < chunk_lo + CHUNK) & (tok < vocab_size) & (tok >= 0)
            bias = tl.load(entry_bias_ptr + idx, mask=em, other=0.0)
            x = tl.load(logits_row + tok, mask=mine, other=-float("inf")).to(tl.float32)
            y = _pipeline(x, tok, mine, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep, rep, inv_rep,
                          output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t, bias)
            tl.store(scratch_row_ptr + tok, y, mask=mine)
        tl.debug_barrier()
        last = tl.load(last_ptr + tl.maximum(state_row, 0), mask=(has_last != 0) & (state_row >= 0), other=-3)
        for e in range(e0, e1, EB):
            idx = e + tl.arange(0, EB)
            em = idx < e1
            tok = tl.load(entry_tokens_ptr + idx, mask=em, other=0)
            mine = em & (tok >= chunk_lo) & (tok < chunk_lo + CHUNK) & (tok < vocab_size) & (tok >= 0)
            after = tl.load(entry_ban_ptr + idx, mask=em, other=-2)
            banned = (after == -1) | ((after >= 0) & (after == last))
            tl.store(scratch_row_ptr + tok, tl.full([EB], -float("inf"), tl.float32), mask=mine & banned)
        tl.debug_barrier()
    if stats != 0:
        # By hand, the loads of the next block are issued before this block is processed: in a loop that stores
        # between its loads, the compiler keeps each block's loads after the last block's stores. Measured on an
        # H100 at 256 rows (benchmarks/RESULTS.md, 2026-12-07 second session): 224 -> 208 us for the target mix,
        # but 156 -> 174 us for --filtered's; so the round trips are not what bounds this pass.
        block = tl.arange(0, TPB)[:, None] * TILE + tl.arange(0, TILE)[None, :]
        cols = chunk_lo + block
        x, g_word, s_word, o_word = _load_raw(src, logits_row, scratch_row_ptr, cols, cols < vocab_size,
                                              grammar_row_ptr, has_grammar, seen_row_ptr, has_rep, output_row_ptr,
                                              has_fp)
        for start in range(0, CHUNK, TILE * TPB):
            cols = chunk_lo + start + block
            mask = cols < vocab_size
            ahead = cols + TILE * TPB
            in_chunk = tl.where(start + TILE * TPB < CHUNK, ahead < vocab_size, False)
            x_next, g_next, s_next, o_next = _load_raw(src, logits_row, scratch_row_ptr, ahead, in_chunk,
                                                       grammar_row_ptr, has_grammar, seen_row_ptr, has_rep,
                                                       output_row_ptr, has_fp)
            y = _from_raw(src, x, g_word, s_word, o_word, cols, mask, counts_row_ptr, rep, inv_rep, freq, pres, inv_t)
            tiles = (chunk_lo + start) // TILE + tl.arange(0, TPB)
            finite = y > -float("inf")
            tmax = tl.max(y, axis=1)
            tmin = tl.min(tl.where(finite, y, float("inf")), axis=1)
            tcnt = tl.sum(finite.to(tl.int32), axis=1)
            shift = tl.where(tmax > -float("inf"), tmax, 0.0)  # no -inf - -inf in a tile without finite entries
            tsum = tl.sum(tl.where(finite, tl.exp(y - shift[:, None]), 0.0), axis=1)
            tm = tiles < num_tiles
            offs = row * num_tiles + tiles
            tl.store(tile_max_ptr + offs, tmax, mask=tm)
            tl.store(tile_min_ptr + offs, tmin, mask=tm)
            tl.store(tile_sum_ptr + offs, tsum, mask=tm)
            tl.store(tile_cnt_ptr + offs, tcnt, mask=tm)
            x, g_word, s_word, o_word = x_next, g_next, s_next, o_next


@triton.jit(do_not_specialize=["num_rows"])  # one compiled variant whatever the value
def _plan_kernel(
    fparams_ptr, iparams_ptr, tile_max_ptr, tile_min_ptr, tile_sum_ptr, tile_cnt_ptr, state_f_ptr, state_i_ptr,
    row_ptr, num_rows, num_tiles, NT: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    (temperature, inv_t, top_p, min_p, rep, inv_rep, freq, pres, top_k, state_row, grammar_row, scratch_row,
     num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar, src, stats, logprobs,
     plain) = _row(fparams_ptr, iparams_ptr, row)
    if stats != 0:
        tiles = tl.arange(0, NT)
        tm = tiles < num_tiles
        offs = row * num_tiles + tiles
        tmax = tl.load(tile_max_ptr + offs, mask=tm, other=-float("inf"))
        tmin = tl.load(tile_min_ptr + offs, mask=tm, other=float("inf"))
        tsum = tl.load(tile_sum_ptr + offs, mask=tm, other=0.0)
        tcnt = tl.load(tile_cnt_ptr + offs, mask=tm, other=0)
        row_max = tl.max(tmax, axis=0)
        finite = tl.sum(tcnt, axis=0)
        row_min = tl.min(tmin, axis=0)
        nonempty = tcnt > 0
        shift = tl.where(row_max > -float("inf"), row_max, 0.0)  # a row without finite entries has no mass
        mass = tl.sum(tl.where(nonempty, tsum * tl.exp(tmax - shift), 0.0), axis=0)
        any_finite = finite > 0
        log_min_p = tl.log(tl.where(use_minp != 0, min_p, 1.0).to(tl.float64))
        tau_min = tl.where((use_minp != 0) & any_finite, (row_max.to(tl.float64) + log_min_p).to(tl.float32),
                           -float("inf"))
        desc = tl.sort(tmax, descending=True)
        # Search A: the threshold.
        k_on = (use_k != 0) & (top_k < finite)
        p_on = use_p != 0
        kind_a = tl.where(k_on & p_on, _COUNT_THEN_MASS, tl.where(k_on, _COUNT, tl.where(p_on, _MASS, 0)))
        target_a = tl.where(k_on, top_k.to(tl.float32), top_p * mass)
        kth = _pick(desc, top_k - 1)  # >= top_k entries lie at or above the k-th largest tile max
        lo_count = tl.where(kth > -float("inf"), kth, row_min)
        tile_mass = tl.cumsum(tl.where(desc > -float("inf"), tl.exp(desc - shift), 0.0), axis=0)
        first = tl.min(tl.where(tile_mass >= target_a * 1.0001, tiles, NT), axis=0)  # margin for rounding
        lo_mass = tl.where(first < NT, _pick(desc, first), row_min)
        lo_a = tl.where(kind_a == _MASS, lo_mass, lo_count)
        clip = (kind_a != _COUNT_THEN_MASS) & (tau_min > lo_a)
        lo_a = tl.where(clip, tau_min, lo_a)
        exact_a = (lo_a >= row_max) | ((kind_a == _MASS) & (target_a <= 0.0))
        status_a = tl.where((kind_a == 0) | (any_finite == 0), _NONE, tl.where(exact_a, _EXACT, _SEARCH))
        hi = _adjacent(row_max, 1)
        fa = state_f_ptr + (num_rows + row) * (2 * _SW)  # state of pass 1
        ia = state_i_ptr + (num_rows + row) * (2 * _SW)
        _store_search(fa, ia, lo_a, hi, lo_a, row_max, target_a, row_max, 0.0, 0.0, status_a, kind_a, 0, 0, 0, 0,
                      tl.where(clip, _CLIPPED, 0))
        # Search B: the top-N entries (never exact before a pass: the collect needs its per-chunk counts).
        target_b = tl.minimum(num_logprobs, finite)
        kth_b = _pick(desc, target_b - 1)
        lo_b = tl.where(kth_b > -float("inf"), kth_b, row_min)
        status_b = tl.where((logprobs != 0) & (target_b > 0), _SEARCH, _NONE)
        _store_search(fa + _SW, ia + _SW, lo_b, hi, lo_b, row_max, target_b.to(tl.float32), row_max, 0.0, 0.0,
                      status_b, _COUNT, 0, 0, 0, 0, 0)
        r = row_ptr + row * _SW
        tl.store(r + _R_MAX, row_max)
        tl.store(r + _R_MASS, mass)
        tl.store(r + _R_FINITE, finite.to(tl.float32))
        tl.store(r + _R_MIN, row_min)
        tl.store(r + _R_TAU_MIN, tau_min)
    else:
        tl.store(row_ptr + row * _SW + _R_TAU, -float("inf"))  # the resolve step sets it for the other rows


@triton.jit(do_not_specialize=["pass_index", "num_rows"])  # one compiled variant whatever the value
def _pivot_kernel(
    logits_ptr, stride_row, fparams_ptr, iparams_ptr, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr,
    tile_max_ptr, state_f_ptr, state_i_ptr, row_ptr, cnt_ptr, mass_ptr, ext_ptr,
    pass_index, num_rows, num_chunks, vocab_size, num_words, num_tiles,
    CHUNK: tl.constexpr, TILE: tl.constexpr, CH: tl.constexpr, CAP_A: tl.constexpr, CAP_B: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    chunk = tl.program_id(1)
    (temperature, inv_t, top_p, min_p, rep, inv_rep, freq, pres, top_k, state_row, grammar_row, scratch_row,
     num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar, src, stats, logprobs,
     plain) = _row(fparams_ptr, iparams_ptr, row)
    if stats != 0:
        prev = (pass_index - 1) * num_rows + row
        here = pass_index * num_rows + row
        start = tl.where(pass_index > 1, prev, here)  # pass 1 evaluates the plan's state
        fa = state_f_ptr + start * (2 * _SW)
        ia = state_i_ptr + start * (2 * _SW)
        if (tl.load(ia) == _SEARCH) | (tl.load(ia + _SW) == _SEARCH):
            row_max = tl.load(row_ptr + row * _SW + _R_MAX)
            (lo_a, hi_a, a_a, b_a, tg_a, kd_a, rp_a, rs_a, st_a, lo_b, hi_b, a_b, b_b, rp_b, rs_b,
             st_b) = _step_searches(state_f_ptr, state_i_ptr, cnt_ptr, mass_ptr, ext_ptr, start // num_rows,
                                    pass_index, pass_index - 1, num_rows, num_chunks, row, chunk, row_max, top_p,
                                    CH, CAP_A, CAP_B)
            on_a = st_a == _SEARCH
            on_b = st_b == _SEARCH
            if on_a | on_b:
                logits_row, scratch_row_ptr, grammar_row_ptr, seen_row_ptr, output_row_ptr, counts_row_ptr = (
                    _row_pointers(logits_ptr, stride_row, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr,
                                  row, scratch_row, grammar_row, state_row, vocab_size, num_words))
                piv_a = tl.where(on_a, _pivots(lo_a, hi_a, a_a, b_a), float("inf"))
                piv_b = tl.where(on_b, _pivots(lo_b, hi_b, a_b, b_b), float("inf"))
                lo_a = tl.where(on_a, lo_a, float("inf"))
                lo_b = tl.where(on_b, lo_b, float("inf"))
                need = tl.minimum(lo_a, lo_b)
                with_mass = on_a & (kd_a != _COUNT)
                acc_ca = tl.zeros([_PV], tl.int32)
                acc_ma = tl.zeros([_PV], tl.float32)
                acc_cb = tl.zeros([_PV], tl.int32)
                mn_a = tl.full([TILE], float("inf"), tl.float32)
                mx_a = tl.full([TILE], -float("inf"), tl.float32)
                mn_b = tl.full([TILE], float("inf"), tl.float32)
                mx_b = tl.full([TILE], -float("inf"), tl.float32)
                maxima, hit, n_hit, rank = _chunk_tiles(tile_max_ptr, row, chunk, num_tiles, need, 0, CHUNK // TILE)
                # Each active tile's loads are issued one tile ahead (as in the prepare kernel).
                cols, tile_max, x, g_word, s_word, o_word = _active_tile_raw(
                    maxima, hit, rank, 0, n_hit, chunk, src, logits_row, scratch_row_ptr, grammar_row_ptr,
                    has_grammar, seen_row_ptr, has_rep, output_row_ptr, has_fp, vocab_size, TILE, CHUNK // TILE)
                for i in range(0, n_hit):
                    cols_next, max_next, x_next, g_next, s_next, o_next = _active_tile_raw(
                        maxima, hit, rank, i + 1, n_hit, chunk, src, logits_row, scratch_row_ptr, grammar_row_ptr,
                        has_grammar, seen_row_ptr, has_rep, output_row_ptr, has_fp, vocab_size, TILE, CHUNK // TILE)
                    y = _from_raw(src, x, g_word, s_word, o_word, cols, cols < vocab_size, counts_row_ptr, rep,
                                  inv_rep, freq, pres, inv_t)
                    if tile_max >= lo_a:  # a tile below a bracket adds nothing to its counts
                        ge_a = y[None, :] >= piv_a[:, None]
                        acc_ca += tl.sum(ge_a.to(tl.int32), axis=1)
                        if with_mass:
                            acc_ma += tl.sum(tl.where(ge_a, tl.exp(y - row_max)[None, :], 0.0), axis=1)
                        in_a = (y >= lo_a) & (y < hi_a)
                        mn_a = tl.minimum(mn_a, tl.where(in_a, y, float("inf")))
                        mx_a = tl.maximum(mx_a, tl.where(in_a, y, -float("inf")))
                    if tile_max >= lo_b:
                        acc_cb += tl.sum((y[None, :] >= piv_b[:, None]).to(tl.int32), axis=1)
                        in_b = (y >= lo_b) & (y < hi_b)
                        mn_b = tl.minimum(mn_b, tl.where(in_b, y, float("inf")))
                        mx_b = tl.maximum(mx_b, tl.where(in_b, y, -float("inf")))
                    x, g_word, s_word, o_word, cols, tile_max = x_next, g_next, s_next, o_next, cols_next, max_next
                j = tl.arange(0, _PV)
                out = (here * num_chunks + chunk) * (2 * _PV)
                tl.store(cnt_ptr + out + j, acc_ca)
                tl.store(mass_ptr + out + j, acc_ma)
                tl.store(cnt_ptr + out + _PV + j, acc_cb)
                tl.store(mass_ptr + out + _PV + j, tl.zeros([_PV], tl.float32))
                e = ext_ptr + (here * num_chunks + chunk) * 4
                tl.store(e + 0, tl.min(mn_a, axis=0))
                tl.store(e + 1, tl.max(mx_a, axis=0))
                tl.store(e + 2, tl.min(mn_b, axis=0))
                tl.store(e + 3, tl.max(mx_b, axis=0))
        elif (pass_index > 1) & (chunk == 0):  # settled searches: carry the state to the next pass
            _copy_state(fa, ia, state_f_ptr + here * (2 * _SW), state_i_ptr + here * (2 * _SW))


@triton.jit
def _copy_state(src_f, src_i, dst_f, dst_i):
    k = tl.arange(0, 2 * _SW)
    tl.store(dst_f + k, tl.load(src_f + k))
    tl.store(dst_i + k, tl.load(src_i + k))


@triton.jit
def _chunk_base(cnt_ptr, num_chunks, chunk, slot, s, CH: tl.constexpr):
    """(entries of search s at or above pivot `slot`, and at or above `slot + 1`) in the chunks before `chunk`
    and in `chunk` itself, from one pass's per-chunk counts."""
    c = tl.arange(0, CH)
    cm = c < num_chunks
    n_lo = tl.load(cnt_ptr + c * (2 * _PV) + s * _PV + slot, mask=cm, other=0)
    n_hi = tl.load(cnt_ptr + c * (2 * _PV) + s * _PV + slot + 1, mask=cm, other=0)
    before = c < chunk
    return tl.sum(tl.where(before, n_lo, 0), axis=0), tl.sum(tl.where(before, n_hi, 0), axis=0)


@triton.jit(do_not_specialize=["last_pass", "num_rows"])  # one compiled variant whatever the value
def _collect_kernel(
    logits_ptr, stride_row, fparams_ptr, iparams_ptr, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr,
    tile_max_ptr, state_f_ptr, state_i_ptr, row_ptr, cnt_ptr, mass_ptr, ext_ptr,
    val_a_ptr, id_a_ptr, val_b_ptr, id_b_ptr, last_pass, num_rows, num_chunks, vocab_size, num_words, num_tiles,
    CHUNK: tl.constexpr, TILE: tl.constexpr, CH: tl.constexpr, CAP_A: tl.constexpr, CAP_B: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    chunk = tl.program_id(1)
    (temperature, inv_t, top_p, min_p, rep, inv_rep, freq, pres, top_k, state_row, grammar_row, scratch_row,
     num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar, src, stats, logprobs,
     plain) = _row(fparams_ptr, iparams_ptr, row)
    if stats != 0:
        row_max = tl.load(row_ptr + row * _SW + _R_MAX)
        (lo_a, hi_a, a_a, b_a, tg_a, kd_a, rp_a, rs_a, st_a, lo_b, hi_b, a_b, b_b, rp_b, rs_b,
         st_b) = _step_searches(state_f_ptr, state_i_ptr, cnt_ptr, mass_ptr, ext_ptr, last_pass, last_pass + 1,
                                last_pass, num_rows, num_chunks, row, chunk, row_max, top_p, CH, CAP_A, CAP_B)
        # Search A: a ready bracket (never more than CAP_A entries). Search B: any state with a valid pass
        # (an exhausted one is truncated to the lowest indices).
        take_a = (st_a == _READY) | (st_a == _READY_UPPER)
        take_b = (st_b != _NONE) & (rp_b >= 1)
        if take_a | take_b:
            upper_a = st_a == _READY_UPPER
            per_pass = num_chunks * (2 * _PV)
            a_lo_before, a_hi_before = _chunk_base(cnt_ptr + (tl.maximum(rp_a, 1) * num_rows + row) * per_pass,
                                                   num_chunks, chunk, rs_a, 0, CH)
            slot_a = tl.where(upper_a, a_lo_before, a_lo_before - a_hi_before)
            b_lo_before, b_hi_before = _chunk_base(cnt_ptr + (tl.maximum(rp_b, 1) * num_rows + row) * per_pass,
                                                   num_chunks, chunk, rs_b, 1, CH)
            slot_b1 = b_hi_before
            slot_b2 = _SEG1 + b_lo_before - b_hi_before
            lo_a = tl.where(take_a, lo_a, float("inf"))
            hi_a = tl.where(upper_a, float("inf"), hi_a)
            lo_b = tl.where(take_b, lo_b, float("inf"))
            hi_b = tl.where(take_b, hi_b, float("inf"))
            need = tl.minimum(lo_a, lo_b)
            logits_row, scratch_row_ptr, grammar_row_ptr, seen_row_ptr, output_row_ptr, counts_row_ptr = (
                _row_pointers(logits_ptr, stride_row, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr,
                              row, scratch_row, grammar_row, state_row, vocab_size, num_words))
            maxima, hit, n_hit, rank = _chunk_tiles(tile_max_ptr, row, chunk, num_tiles, need, 0, CHUNK // TILE)
            # Each active tile's loads are issued one tile ahead (as in the prepare kernel).
            cols, _, x, g_word, s_word, o_word = _active_tile_raw(
                maxima, hit, rank, 0, n_hit, chunk, src, logits_row, scratch_row_ptr, grammar_row_ptr, has_grammar,
                seen_row_ptr, has_rep, output_row_ptr, has_fp, vocab_size, TILE, CHUNK // TILE)
            for i in range(0, n_hit):  # ascending tile order: the slots stay in index order
                cols_next, _, x_next, g_next, s_next, o_next = _active_tile_raw(
                    maxima, hit, rank, i + 1, n_hit, chunk, src, logits_row, scratch_row_ptr, grammar_row_ptr,
                    has_grammar, seen_row_ptr, has_rep, output_row_ptr, has_fp, vocab_size, TILE, CHUNK // TILE)
                y = _from_raw(src, x, g_word, s_word, o_word, cols, cols < vocab_size, counts_row_ptr, rep, inv_rep,
                              freq, pres, inv_t)
                in_a = (y >= lo_a) & (y < hi_a)
                pos = slot_a + tl.cumsum(in_a.to(tl.int32), axis=0) - 1
                keep = in_a & (pos < CAP_A)
                tl.store(val_a_ptr + row * CAP_A + pos, y, mask=keep)
                tl.store(id_a_ptr + row * CAP_A + pos, cols, mask=keep)
                slot_a += tl.sum(in_a.to(tl.int32), axis=0)
                above_b = y >= hi_b
                pos = slot_b1 + tl.cumsum(above_b.to(tl.int32), axis=0) - 1
                keep = above_b & (pos < _SEG1)
                tl.store(val_b_ptr + row * CAP_B + pos, y, mask=keep)
                tl.store(id_b_ptr + row * CAP_B + pos, cols, mask=keep)
                slot_b1 += tl.sum(above_b.to(tl.int32), axis=0)
                in_b = (y >= lo_b) & (y < hi_b)
                pos = slot_b2 + tl.cumsum(in_b.to(tl.int32), axis=0) - 1
                keep = in_b & (pos < CAP_B)
                tl.store(val_b_ptr + row * CAP_B + pos, y, mask=keep)
                tl.store(id_b_ptr + row * CAP_B + pos, cols, mask=keep)
                slot_b2 += tl.sum(in_b.to(tl.int32), axis=0)
                x, g_word, s_word, o_word, cols = x_next, g_next, s_next, o_next, cols_next


@triton.jit
def _sorted_entries(val_ptr, id_ptr, valid, SIZE: tl.constexpr):
    """The valid slots of a buffer sorted by value descending, then index ascending: (values, ids, is_valid),
    invalid slots last (value -inf)."""
    v = tl.load(val_ptr + tl.arange(0, SIZE), mask=valid, other=0.0)
    ids = tl.load(id_ptr + tl.arange(0, SIZE), mask=valid, other=0)
    high = ~_order_key(v)
    key = tl.where(valid, (high.to(tl.int64) << 32) | ids.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    key = tl.sort(key)
    ok = key != 0x7FFFFFFFFFFFFFFF
    values = tl.where(ok, _from_order_key(~((key >> 32).to(tl.int32))), -float("inf"))
    return values, (key & 0x7FFFFFFF).to(tl.int32), ok


@triton.jit
def _buffer_threshold(val_ptr, id_ptr, n, upper, kind, target, top_k, top_p, c_hi, g_hi, lo, row_max, flags,
                      SIZE: tl.constexpr):
    """The exact threshold from the `n` (<= SIZE) collected entries of a search A buffer: the upper set of a
    top-k-then-top-p search (`upper`), or the bracket [lo, hi) of a count or mass search, whose count and mass
    at hi are `c_hi` and `g_hi`. Returns (tau, flags | 1 if rounding made the mass search miss)."""
    slots = tl.arange(0, SIZE)
    values, ids, ok = _sorted_entries(val_ptr, id_ptr, slots < n, SIZE)
    w = tl.where(ok, tl.exp(values - row_max), 0.0)
    mass_before = tl.cumsum(w, axis=0)
    if upper:  # top-k, then top-p over its mass
        tau_k = _pick(values, top_k - 1)
        in_k = ok & (values >= tau_k)
        g_k = tl.sum(tl.where(in_k, w, 0.0), axis=0)
        last_k = tl.sum(in_k.to(tl.int32), axis=0) - 1
        found = tl.min(tl.where((mass_before >= top_p * g_k) & ok, slots, SIZE), axis=0)
        tau = _pick(values, tl.minimum(found, last_k))
    elif kind == _MASS:
        found = tl.min(tl.where(((g_hi + mass_before) >= target) & ok, slots, SIZE), axis=0)
        tau = tl.where(found < SIZE, _pick(values, found), lo)
        flags = tl.where(found < SIZE, flags, 1)
    else:
        tau = _pick(values, target.to(tl.int32) - c_hi - 1)
    return tau, flags


@triton.jit(do_not_specialize=["final_pass", "num_rows"])  # one compiled variant whatever the value
def _resolve_kernel(
    fparams_ptr, iparams_ptr, state_f_ptr, state_i_ptr, row_ptr, val_a_ptr, id_a_ptr, val_b_ptr, id_b_ptr,
    top_v_ptr, top_id_ptr, flags_ptr, final_pass, num_rows, NB: tl.constexpr, CAP_A: tl.constexpr,
    CAP_B: tl.constexpr, SMALL_A: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    (temperature, inv_t, top_p, min_p, rep, inv_rep, freq, pres, top_k, state_row, grammar_row, scratch_row,
     num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar, src, stats, logprobs,
     plain) = _row(fparams_ptr, iparams_ptr, row)
    if stats != 0:
        r = row_ptr + row * _SW
        row_max = tl.load(r + _R_MAX)
        tau_min = tl.load(r + _R_TAU_MIN)
        fa = state_f_ptr + (final_pass * num_rows + row) * (2 * _SW)
        ia = state_i_ptr + (final_pass * num_rows + row) * (2 * _SW)
        lo, hi, a, b, target, tau, g_lo, g_hi, status, kind, ref_pass, ref_slot, c_lo, c_hi, sflags = _load_search(
            fa, ia)
        tau_a = tl.where(status == _EXACT, tau, tl.where(status == _SEARCH, lo, -float("inf")))
        # The passes ran out (keep the whole bracket) or a bracket lost its lower end to rounding.
        flags = tl.where((status == _SEARCH) | ((sflags & _ROUNDED) != 0), 1, 0)
        if (status == _READY) | (status == _READY_UPPER):
            upper = status == _READY_UPPER
            n = tl.where(upper, c_lo, c_lo - c_hi)
            if n <= SMALL_A:  # the usual bracket: a smaller sort
                tau_a, flags = _buffer_threshold(val_a_ptr + row * CAP_A, id_a_ptr + row * CAP_A, n, upper, kind,
                                                 target, top_k, top_p, c_hi, g_hi, lo, row_max, flags, SMALL_A)
            else:
                tau_a, flags = _buffer_threshold(val_a_ptr + row * CAP_A, id_a_ptr + row * CAP_A, n, upper, kind,
                                                 target, top_k, top_p, c_hi, g_hi, lo, row_max, flags, CAP_A)
        tau_row = tl.maximum(tau_a, tau_min)
        tl.store(r + _R_TAU, tau_row)
        lo_b, hi_b, a_b, b_b, tg_b, tau_b, gl_b, gh_b, st_b, kd_b, rp_b, rs_b, cl_b, ch_b, fl_b = _load_search(
            fa + _SW, ia + _SW)
        s = tl.arange(0, NB)
        top_v = tl.full([NB], -float("inf"), tl.float32)
        top_id = tl.full([NB], -1, tl.int32)
        if st_b != _NONE:
            slots = tl.arange(0, CAP_B)
            n2 = tl.minimum(cl_b - ch_b, CAP_B - _SEG1)
            valid = (slots < ch_b) | ((slots >= _SEG1) & (slots < _SEG1 + n2))
            values, ids, ok = _sorted_entries(val_b_ptr + row * CAP_B, id_b_ptr + row * CAP_B, valid, CAP_B)
            flags = tl.where(st_b == _SEARCH, flags | 2, flags)
            v = _first(values, NB)
            kept = (s < num_logprobs) & (s < tg_b.to(tl.int32)) & (v >= tau_row) & (v > -float("inf"))
            top_v = tl.where(kept, v, -float("inf"))
            top_id = tl.where(kept, _first_int(ids, NB), -1)
        tl.store(top_v_ptr + row * NB + s, top_v)
        tl.store(top_id_ptr + row * NB + s, top_id)
        tl.store(flags_ptr + row, flags)
    else:
        tl.store(flags_ptr + row, 0)
