"""The Triton kernels of the processed-row sampler, in launch order after their helpers. The design, the
semantics and the entry point are in gpu_kernels/processed_sampling.py.

Every helper here is a device function; the Triton interpreter re-patches triton.language on each device call,
so the hot paths keep the nesting shallow (which changes nothing once compiled: device functions are inlined).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu_kernels.sampling import _chunk_best
from gpu_kernels.sampling_inputs import NUM_FLOAT_COLUMNS, NUM_INT_COLUMNS

PIVOTS = 16  # per search and pass: the bracket's two ends and 14 points inside it
DEFAULT_CAP_A = 1024  # entries of a threshold bracket the resolve step sorts
SEG1 = 32  # top-N buffer slots for the entries above the top-N bracket (fewer than N <= MAX_TOP)
DEFAULT_CAP_B = 128  # top-N buffer: SEG1 slots, then CAP_B - SEG1 for the bracket's entries
MAX_TOP = 32  # the widest top-N output
DEFAULT_TILE = 256  # entries a tile statistic covers: the granularity at which passes skip
DEFAULT_NUM_PASSES = 4
STATE_WIDTH = 8  # floats (and as many ints) of one search's state, and of a row's state

_PV = tl.constexpr(PIVOTS)
_SEG1 = tl.constexpr(SEG1)
_SW = tl.constexpr(STATE_WIDTH)
_NF = tl.constexpr(NUM_FLOAT_COLUMNS)
_NI = tl.constexpr(NUM_INT_COLUMNS)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# Search status.
_NONE = tl.constexpr(0)  # no search: the threshold is -inf
_SEARCH = tl.constexpr(1)  # the pivots of the state are evaluated in the next pass
_READY = tl.constexpr(2)  # the bracket [lo, hi) is collected and sorted
_READY_UPPER = tl.constexpr(3)  # the whole upper set [lo, inf) is collected (top-k then top-p)
_EXACT = tl.constexpr(4)  # the threshold is `tau`
_BELOW = tl.constexpr(5)  # the threshold lies below min-p's, which decides
# Search kinds.
_COUNT = tl.constexpr(1)
_MASS = tl.constexpr(2)
_COUNT_THEN_MASS = tl.constexpr(3)
# State flags.
_CLIPPED = tl.constexpr(1)  # lo was raised to tau_min
_ROUNDED = tl.constexpr(2)
# Row state columns (float32).
_R_MAX = tl.constexpr(0)
_R_MASS = tl.constexpr(1)
_R_FINITE = tl.constexpr(2)
_R_MIN = tl.constexpr(3)
_R_TAU_MIN = tl.constexpr(4)
_R_TAU = tl.constexpr(5)
_R_Y_TOKEN = tl.constexpr(6)
_R_KEPT_MASS = tl.constexpr(7)


# ============================================================================ per-row parameters
@triton.jit
def _row(fparams_ptr, iparams_ptr, row):
    """A row's parameters (the F_* and I_* columns) and its int32 0/1 flags: sampled, top-k, top-p, min-p,
    repetition, frequency/presence, grammar; `src`, where y comes from (0: logits * 1/T, 1: with the repetition
    penalty only, 2: the scratch row, 3: the whole pipeline); `stats` (it filters or reports logprobs: tile
    statistics and searches); logprobs; plain (temperature only: gpu_kernels/sampling.py's scan)."""
    f = fparams_ptr + row * _NF
    i = iparams_ptr + row * _NI
    temperature = tl.load(f + 0)
    rep = tl.load(f + 4)
    freq = tl.load(f + 6)
    pres = tl.load(f + 7)
    top_k = tl.load(i + 0)
    top_p = tl.load(f + 2)
    min_p = tl.load(f + 3)
    state_row = tl.load(i + 1)
    grammar_row = tl.load(i + 2)
    scratch_row = tl.load(i + 3)
    num_logprobs = tl.load(i + 4)
    sampled = (temperature > 0).to(tl.int32)
    use_k = sampled & (top_k > 0).to(tl.int32)
    use_p = sampled & (top_p < 1.0).to(tl.int32)
    use_minp = sampled & (min_p > 0.0).to(tl.int32)
    has_state = (state_row >= 0).to(tl.int32)
    has_rep = has_state & (rep != 1.0).to(tl.int32)
    has_fp = has_state & ((freq != 0.0) | (pres != 0.0)).to(tl.int32)
    has_grammar = (grammar_row >= 0).to(tl.int32)
    from_scratch = (scratch_row >= 0).to(tl.int32)
    logprobs = (num_logprobs >= 0).to(tl.int32)
    src = tl.where(from_scratch != 0, 2, tl.where((has_fp | has_grammar) != 0, 3, tl.where(has_rep != 0, 1, 0)))
    stats = use_k | use_p | use_minp | logprobs
    plain = tl.where((stats | has_rep | has_fp | has_grammar | from_scratch) != 0, 0, 1)
    return (temperature, tl.load(f + 1), top_p, min_p, rep, tl.load(f + 5), freq, pres, top_k, state_row,
            grammar_row, scratch_row, num_logprobs, sampled, use_k, use_p, use_minp, has_rep, has_fp, has_grammar,
            src, stats, logprobs, plain)


# ============================================================================ the processed logits y
@triton.jit
def _pipeline(x, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr,
              counts_row_ptr, has_fp, freq, pres, inv_t, bias):
    """Steps 1-5 of gpu_kernels/processed_sampling.py's semantics on logits `x` (float32, any shape) at indices `cols`;
    `bias` is added after the grammar (0 for a dense tile). The bit loads of unused steps are masked off.
    NaN becomes -inf (it never wins) and +inf the largest float (tied at the top)."""
    # (A vector mask combines with a scalar flag through tl.where: the interpreter mistypes `mask & flag`.)
    words = cols >> 5
    bit = cols & 31
    allowed = (tl.load(grammar_row_ptr + words, mask=tl.where(has_grammar != 0, mask, False), other=-1) >> bit) & 1
    x = tl.where(allowed != 0, x, -float("inf")) + bias
    seen = (tl.load(seen_row_ptr + words, mask=tl.where(has_rep != 0, mask, False), other=0) >> bit) & 1
    x = tl.where(seen != 0, tl.where(x > 0, x * inv_rep, x * rep), x)
    generated = (tl.load(output_row_ptr + words, mask=tl.where(has_fp != 0, mask, False), other=0) >> bit) & 1
    count = tl.load(counts_row_ptr + cols, mask=mask & (generated != 0), other=0).to(tl.float32)
    x = (x - freq * count - pres * (count > 0).to(tl.float32)) * inv_t
    return tl.minimum(tl.where(x == x, x, -float("inf")), _FLT_MAX)


@triton.jit
def _load_y(src, logits_row_ptr, scratch_row_ptr, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep,
            rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t):
    """The processed logits y (float32, -inf where `mask` is off) of one row at `cols` (`src`: see _row)."""
    if src == 2:
        y = tl.load(scratch_row_ptr + cols, mask=mask, other=-float("inf"))
    elif src == 3:
        x = tl.load(logits_row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = _pipeline(x, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep, rep, inv_rep,
                      output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t, 0.0)
    elif src == 1:  # the --filtered mix: no grammar or count instructions at all
        x = tl.load(logits_row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
        seen = (tl.load(seen_row_ptr + (cols >> 5), mask=mask, other=0) >> (cols & 31)) & 1
        x = tl.where(seen != 0, tl.where(x > 0, x * inv_rep, x * rep), x) * inv_t
        y = tl.minimum(tl.where(x == x, x, -float("inf")), _FLT_MAX)
    else:
        x = tl.load(logits_row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
        y = tl.minimum(tl.where(x == x, x, -float("inf")), _FLT_MAX)
    return y


# ============================================================================ ordered keys and pivots
@triton.jit
def _order_key(v):
    """int32 key increasing with the float v (not NaN); -0.0 and +0.0 get the same key."""
    b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(k):
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _adjacent(v, step):
    """The float `step` (+1 or -1) places above v in the order of _order_key (one nested call, not three:
    the interpreter re-patches triton.language on every device-function call)."""
    b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    k = (b ^ ((b >> 31) & 0x7FFFFFFF)) + step
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _pick(vec, j):
    """vec[j] of a 1-D float tensor (-inf if j is out of range)."""
    return tl.max(tl.where(tl.arange(0, vec.shape[0]) == j, vec, -float("inf")), axis=0)


@triton.jit
def _pivots(lo, hi, a, b):
    """The PIVOTS pivots of bracket [lo, hi) whose entries lie in [a, b], ascending: lo, just above a (splits a
    off), PIVOTS - 4 evenly inside (a, b), b (splits b off), hi. A bracket of two or more values always shrinks."""
    j = tl.arange(0, _PV)
    first = tl.where(a < b, _adjacent(a, 1), b)
    mid = a + (b - a) * ((j - 1).to(tl.float32) * (1.0 / (_PV - 2)))
    mid = tl.minimum(tl.maximum(mid, first), b)
    return tl.where(j == 0, lo, tl.where(j == 1, first, tl.where(j == _PV - 2, b, tl.where(j == _PV - 1, hi, mid))))


# ============================================================================ search state
@triton.jit
def _load_search(f_ptr, i_ptr):
    return (tl.load(f_ptr + 0), tl.load(f_ptr + 1), tl.load(f_ptr + 2), tl.load(f_ptr + 3), tl.load(f_ptr + 4),
            tl.load(f_ptr + 5), tl.load(f_ptr + 6), tl.load(f_ptr + 7), tl.load(i_ptr + 0), tl.load(i_ptr + 1),
            tl.load(i_ptr + 2), tl.load(i_ptr + 3), tl.load(i_ptr + 4), tl.load(i_ptr + 5), tl.load(i_ptr + 6))


@triton.jit
def _store_search(f_ptr, i_ptr, lo, hi, a, b, target, tau, g_lo, g_hi, status, kind, ref_pass, ref_slot, c_lo,
                  c_hi, flags):
    """A search: bracket [lo, hi) with entries in [a, b]; target count or mass; tau when exact; the mass and
    count at lo and hi; status and kind; the pass and pivot slot whose per-chunk partials hold lo (hi is the
    next slot); flags (_CLIPPED, _ROUNDED)."""
    tl.store(f_ptr + 0, lo)
    tl.store(f_ptr + 1, hi)
    tl.store(f_ptr + 2, a)
    tl.store(f_ptr + 3, b)
    tl.store(f_ptr + 4, target)
    tl.store(f_ptr + 5, tau)
    tl.store(f_ptr + 6, g_lo)
    tl.store(f_ptr + 7, g_hi)
    tl.store(i_ptr + 0, status)
    tl.store(i_ptr + 1, kind)
    tl.store(i_ptr + 2, ref_pass)
    tl.store(i_ptr + 3, ref_slot)
    tl.store(i_ptr + 4, c_lo)
    tl.store(i_ptr + 5, c_hi)
    tl.store(i_ptr + 6, flags)


@triton.jit
def _pass_sums(cnt_ptr, mass_ptr, ext_ptr, s, num_chunks, CH: tl.constexpr):
    """Search s's counts [PIVOTS], masses [PIVOTS], bracket min and max over a row's chunks of one pass."""
    c = tl.arange(0, CH)
    j = tl.arange(0, _PV)
    cm = c < num_chunks
    offs = c[:, None] * (2 * _PV) + s * _PV + j[None, :]
    cnt = tl.sum(tl.load(cnt_ptr + offs, mask=cm[:, None], other=0), axis=0)
    mass = tl.sum(tl.load(mass_ptr + offs, mask=cm[:, None], other=0.0), axis=0)
    bmin = tl.min(tl.load(ext_ptr + c * 4 + s * 2, mask=cm, other=float("inf")), axis=0)
    bmax = tl.max(tl.load(ext_ptr + c * 4 + s * 2 + 1, mask=cm, other=-float("inf")), axis=0)
    return cnt, mass, bmin, bmax


@triton.jit
def _advance(lo, hi, a, b, target, tau, g_lo, g_hi, status, kind, ref_pass, ref_slot, c_lo, c_hi, flags,
             cnt, mass, bmin, bmax, pass_index, row_max, top_p, cap, cap_upper):
    """One step of a search from the partials of the pass that evaluated its pivots (scalar logic, the same in
    every program of the row). Returns the new state (see _store_search)."""
    j = tl.arange(0, _PV)
    t = _pivots(lo, hi, a, b)
    value = tl.where(kind == _MASS, mass, cnt.to(tl.float32))
    top = tl.max(tl.where(value >= target, j, -1), axis=0)  # value is non-increasing in j
    below = top < 0
    top = tl.minimum(tl.maximum(top, 0), _PV - 2)
    at_lo = j == top
    at_hi = j == top + 1
    new_lo = tl.max(tl.where(at_lo, t, -float("inf")), axis=0)
    new_hi = tl.max(tl.where(at_hi, t, -float("inf")), axis=0)
    n_lo = tl.sum(tl.where(at_lo, cnt, 0), axis=0)
    n_hi = tl.sum(tl.where(at_hi, cnt, 0), axis=0)
    m_lo = tl.sum(tl.where(at_lo, mass, 0.0), axis=0)
    m_hi = tl.sum(tl.where(at_hi, mass, 0.0), axis=0)
    a2 = tl.maximum(new_lo, bmin)
    b2 = tl.minimum(_adjacent(new_hi, -1), bmax)
    single = a2 >= b2  # the new bracket holds one distinct value, a2
    nested = kind == _COUNT_THEN_MASS
    upper = nested & (n_lo <= cap_upper)
    fits = (n_lo - n_hi) <= cap
    start_mass = nested & single & (upper == 0)  # top-k exact (tau_k = a2): the top-p search starts above it
    mass_target = top_p * m_lo
    mass_done = start_mass & ((mass_target <= 0.0) | (a2 >= row_max))  # top-p keeps the top value only
    clipped = (flags & _CLIPPED) != 0
    st = tl.where(below, tl.where(clipped, _BELOW, _EXACT),
                  tl.where(upper, _READY_UPPER,
                           tl.where(mass_done, _EXACT,
                                    tl.where(start_mass, _SEARCH,
                                             tl.where(single, _EXACT, tl.where(fits & (nested == 0), _READY,
                                                                                  _SEARCH))))))
    new_tau = tl.where(below, lo, tl.where(mass_done, row_max, a2))
    new_flags = tl.where(below & (clipped == 0), flags | _ROUNDED, flags)
    out_lo = tl.where(start_mass, a2, new_lo)
    out_hi = tl.where(start_mass, _adjacent(row_max, 1), new_hi)
    out_a = a2
    out_b = tl.where(start_mass, row_max, b2)
    out_kind = tl.where(start_mass, _MASS, kind)
    out_target = tl.where(start_mass, mass_target, target)
    out_ref = tl.where(start_mass, -1, pass_index)
    active = status == _SEARCH
    return (tl.where(active, out_lo, lo), tl.where(active, out_hi, hi), tl.where(active, out_a, a),
            tl.where(active, out_b, b), tl.where(active, out_target, target), tl.where(active, new_tau, tau),
            tl.where(active, m_lo, g_lo), tl.where(active, m_hi, g_hi), tl.where(active, st, status),
            tl.where(active, out_kind, kind), tl.where(active, out_ref, ref_pass), tl.where(active, top, ref_slot),
            tl.where(active, n_lo, c_lo), tl.where(active, n_hi, c_hi), tl.where(active, new_flags, flags))


@triton.jit
def _step_searches(state_f_ptr, state_i_ptr, cnt_ptr, mass_ptr, ext_ptr, src, dst, evaluated, num_rows, num_chunks,
                   row, chunk, row_max, top_p, CH: tl.constexpr, CAP_A: tl.constexpr, CAP_B: tl.constexpr):
    """Both searches of a row from state `src`, each advanced by the partials of pass `evaluated` (0: none)
    when it was searching; chunk 0 stores the result as state `dst` (when it differs from `src`)."""
    fs = state_f_ptr + (src * num_rows + row) * (2 * _SW)
    i_s = state_i_ptr + (src * num_rows + row) * (2 * _SW)
    lo_a, hi_a, a_a, b_a, tg_a, tau_a, gl_a, gh_a, st_a, kd_a, rp_a, rs_a, cl_a, ch_a, fl_a = _load_search(fs, i_s)
    lo_b, hi_b, a_b, b_b, tg_b, tau_b, gl_b, gh_b, st_b, kd_b, rp_b, rs_b, cl_b, ch_b, fl_b = _load_search(
        fs + _SW, i_s + _SW)
    if evaluated >= 1:
        at = evaluated * num_rows + row
        if st_a == _SEARCH:
            cnt, mass, bmin, bmax = _pass_sums(cnt_ptr + at * num_chunks * (2 * _PV), mass_ptr + at * num_chunks
                                               * (2 * _PV), ext_ptr + at * num_chunks * 4, 0, num_chunks, CH)
            lo_a, hi_a, a_a, b_a, tg_a, tau_a, gl_a, gh_a, st_a, kd_a, rp_a, rs_a, cl_a, ch_a, fl_a = _advance(
                lo_a, hi_a, a_a, b_a, tg_a, tau_a, gl_a, gh_a, st_a, kd_a, rp_a, rs_a, cl_a, ch_a, fl_a,
                cnt, mass, bmin, bmax, evaluated, row_max, top_p, CAP_A, CAP_A)
        if st_b == _SEARCH:
            cnt, mass, bmin, bmax = _pass_sums(cnt_ptr + at * num_chunks * (2 * _PV), mass_ptr + at * num_chunks
                                               * (2 * _PV), ext_ptr + at * num_chunks * 4, 1, num_chunks, CH)
            lo_b, hi_b, a_b, b_b, tg_b, tau_b, gl_b, gh_b, st_b, kd_b, rp_b, rs_b, cl_b, ch_b, fl_b = _advance(
                lo_b, hi_b, a_b, b_b, tg_b, tau_b, gl_b, gh_b, st_b, kd_b, rp_b, rs_b, cl_b, ch_b, fl_b,
                cnt, mass, bmin, bmax, evaluated, row_max, top_p, CAP_B - _SEG1, 0)
        if chunk == 0:
            fd = state_f_ptr + (dst * num_rows + row) * (2 * _SW)
            i_d = state_i_ptr + (dst * num_rows + row) * (2 * _SW)
            _store_search(fd, i_d, lo_a, hi_a, a_a, b_a, tg_a, tau_a, gl_a, gh_a, st_a, kd_a, rp_a, rs_a, cl_a, ch_a,
                          fl_a)
            _store_search(fd + _SW, i_d + _SW, lo_b, hi_b, a_b, b_b, tg_b, tau_b, gl_b, gh_b, st_b, kd_b, rp_b, rs_b,
                          cl_b, ch_b, fl_b)
    return (lo_a, hi_a, a_a, b_a, tg_a, kd_a, rp_a, rs_a, st_a, lo_b, hi_b, a_b, b_b, rp_b, rs_b, st_b)


@triton.jit
def _row_pointers(logits_ptr, stride_row, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr, row,
                  scratch_row, grammar_row, state_row, vocab_size, num_words):
    """The row's logits, scratch row, grammar bitmask row and penalty rows (row 0 where it has none)."""
    srow = tl.maximum(state_row, 0).to(tl.int64)
    return (logits_ptr + row * stride_row, scratch_ptr + tl.maximum(scratch_row, 0).to(tl.int64) * vocab_size,
            bitmask_ptr + tl.maximum(grammar_row, 0).to(tl.int64) * num_words, seen_ptr + srow * num_words,
            output_ptr + srow * num_words, counts_ptr + srow * vocab_size)


@triton.jit
def _chunk_tiles(tile_max_ptr, row, chunk, num_tiles, bound, strict, NTC: tl.constexpr):
    """The maxima `[NTC]` of the chunk's tiles, which of them reach `bound` (exceed it if `strict`; empty tiles
    never do), how many, and each one's rank among them: one vector load, so a loop over the active tiles
    waits on no scalar load per tile."""
    t = chunk * NTC + tl.arange(0, NTC)
    maxima = tl.load(tile_max_ptr + row * num_tiles + t, mask=t < num_tiles, other=-float("inf"))
    hit = tl.where(strict != 0, maxima > bound, maxima >= bound) & (maxima > -float("inf"))
    rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    return maxima, hit, tl.sum(hit.to(tl.int32), axis=0), rank


@triton.jit
def _nth_tile(maxima, hit, rank, i, chunk, NTC: tl.constexpr):
    """(global index, max) of the i-th active tile of the chunk."""
    t = tl.arange(0, NTC)
    at = hit & (rank == i)
    return chunk * NTC + tl.sum(tl.where(at, t, 0), axis=0), tl.max(tl.where(at, maxima, -float("inf")), axis=0)


# ============================================================================ kernels, in launch order
@triton.jit(do_not_specialize=["has_last"])  # one compiled variant whatever the value
def _prepare_kernel(
    logits_ptr, stride_row, fparams_ptr, iparams_ptr, scratch_ptr, bitmask_ptr, seen_ptr, output_ptr, counts_ptr,
    offsets_ptr, entry_tokens_ptr, entry_bias_ptr, entry_ban_ptr, last_ptr, has_last,
    tile_max_ptr, tile_min_ptr, tile_sum_ptr, tile_cnt_ptr, vocab_size, num_words, num_tiles,
    CHUNK: tl.constexpr, TILE: tl.constexpr, TPB: tl.constexpr, EB: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
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
        for start in range(0, CHUNK, TILE * TPB):
            tiles = (chunk_lo + start) // TILE + tl.arange(0, TPB)
            cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
            mask = cols < vocab_size
            y = _load_y(src, logits_row, scratch_row_ptr, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr,
                        has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t)
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


@triton.jit(do_not_specialize=["num_rows"])  # one compiled variant whatever the value
def _plan_kernel(
    fparams_ptr, iparams_ptr, tile_max_ptr, tile_min_ptr, tile_sum_ptr, tile_cnt_ptr, state_f_ptr, state_i_ptr,
    row_ptr, num_rows, num_tiles, NT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
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
):
    row = tl.program_id(0).to(tl.int64)
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
                acc_ca = tl.zeros([_PV, TILE], tl.int32)
                acc_ma = tl.zeros([_PV, TILE], tl.float32)
                acc_cb = tl.zeros([_PV, TILE], tl.int32)
                mn_a = tl.full([TILE], float("inf"), tl.float32)
                mx_a = tl.full([TILE], -float("inf"), tl.float32)
                mn_b = tl.full([TILE], float("inf"), tl.float32)
                mx_b = tl.full([TILE], -float("inf"), tl.float32)
                maxima, hit, n_hit, rank = _chunk_tiles(tile_max_ptr, row, chunk, num_tiles, need, 0, CHUNK // TILE)
                for i in range(0, n_hit):
                    tile, tile_max = _nth_tile(maxima, hit, rank, i, chunk, CHUNK // TILE)
                    cols = tile * TILE + tl.arange(0, TILE)
                    y = _load_y(src, logits_row, scratch_row_ptr, cols, cols < vocab_size, grammar_row_ptr,
                                has_grammar, seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr,
                                has_fp, freq, pres, inv_t)
                    if tile_max >= lo_a:  # a tile below a bracket adds nothing to its counts
                        ge_a = y[None, :] >= piv_a[:, None]
                        acc_ca += ge_a.to(tl.int32)
                        if with_mass:
                            acc_ma += tl.where(ge_a, tl.exp(y - row_max)[None, :], 0.0)
                        in_a = (y >= lo_a) & (y < hi_a)
                        mn_a = tl.minimum(mn_a, tl.where(in_a, y, float("inf")))
                        mx_a = tl.maximum(mx_a, tl.where(in_a, y, -float("inf")))
                    if tile_max >= lo_b:
                        acc_cb += (y[None, :] >= piv_b[:, None]).to(tl.int32)
                        in_b = (y >= lo_b) & (y < hi_b)
                        mn_b = tl.minimum(mn_b, tl.where(in_b, y, float("inf")))
                        mx_b = tl.maximum(mx_b, tl.where(in_b, y, -float("inf")))
                j = tl.arange(0, _PV)
                out = (here * num_chunks + chunk) * (2 * _PV)
                tl.store(cnt_ptr + out + j, tl.sum(acc_ca, axis=1))
                tl.store(mass_ptr + out + j, tl.sum(acc_ma, axis=1))
                tl.store(cnt_ptr + out + _PV + j, tl.sum(acc_cb, axis=1))
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
):
    row = tl.program_id(0).to(tl.int64)
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
            for i in range(0, n_hit):  # ascending tile order: the slots stay in index order
                tile, tile_max = _nth_tile(maxima, hit, rank, i, chunk, CHUNK // TILE)
                cols = tile * TILE + tl.arange(0, TILE)
                y = _load_y(src, logits_row, scratch_row_ptr, cols, cols < vocab_size, grammar_row_ptr,
                            has_grammar, seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr,
                            has_fp, freq, pres, inv_t)
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
    CAP_B: tl.constexpr, SMALL_A: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
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


@triton.jit
def _first(values, NB: tl.constexpr):
    """values[:NB] of a longer 1-D float tensor."""
    s = tl.arange(0, NB)
    k = tl.arange(0, values.shape[0])
    return tl.max(tl.where(k[None, :] == s[:, None], values[None, :], -float("inf")), axis=1)


@triton.jit
def _first_int(values, NB: tl.constexpr):
    s = tl.arange(0, NB)
    k = tl.arange(0, values.shape[0])
    return tl.sum(tl.where(k[None, :] == s[:, None], values[None, :], 0), axis=1)


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
    CHUNK: tl.constexpr, TILE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
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
            best_score = tl.full([BLOCK_V // 4, 4], -float("inf"), tl.float32)
            best_index = tl.full([BLOCK_V // 4, 4], vocab_size, tl.int32)
            best_y = tl.full([BLOCK_V // 4, 4], -float("inf"), tl.float32)
            kept_mass = tl.zeros([BLOCK_V // 4, 4], tl.float32)
            for start in range(0, CHUNK, BLOCK_V):
                best_score, best_index, best_y, kept_mass = _sample_block(
                    chunk * CHUNK + start, BLOCK_V // 4, src, logits_row, scratch_row_ptr, grammar_row_ptr,
                    has_grammar, seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq,
                    pres, inv_t, vocab_size, tau, sampled, seed, logprobs, row_max, best_score, best_index, best_y,
                    kept_mass)
            top, index, y_index, mass = _lane_winner(best_score, best_index, best_y, kept_mass, vocab_size)
        else:
            best_score = tl.full([TILE // 4, 4], -float("inf"), tl.float32)
            best_index = tl.full([TILE // 4, 4], vocab_size, tl.int32)
            best_y = tl.full([TILE // 4, 4], -float("inf"), tl.float32)
            kept_mass = tl.zeros([TILE // 4, 4], tl.float32)
            for i in range(0, n_hit):
                tile, tile_max = _nth_tile(maxima, hit, rank, i, chunk, CHUNK // TILE)
                best_score, best_index, best_y, kept_mass = _sample_block(
                    tile * TILE, TILE // 4, src, logits_row, scratch_row_ptr, grammar_row_ptr, has_grammar,
                    seen_row_ptr, has_rep, rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres,
                    inv_t, vocab_size, tau, sampled, seed, logprobs, row_max, best_score, best_index, best_y,
                    kept_mass)
            top, index, y_index, mass = _lane_winner(best_score, best_index, best_y, kept_mass, vocab_size)
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
    CHUNK: tl.constexpr, TILE: tl.constexpr, CH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
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


@triton.jit
def _finish_kernel(
    iparams_ptr, row_ptr, rank_ptr, top_v_ptr, top_id_ptr, flags_ptr, overflow_ptr,
    logprob_ptr, rank_out_ptr, top_logprob_ptr, top_ids_ptr, threshold_ptr, flags_out_ptr, num_chunks, num_top,
    CH: tl.constexpr, NB: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
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
