"""The constants and device functions the processed-row sampler's kernels share: per-row parameters, the
processed logits y, ordered keys and pivots, the search state and its step, row pointers and active tiles. The
kernels are in gpu_kernels/processed_sampling_kernels.py (the threshold search: prepare, plan, pivot, collect,
resolve) and gpu_kernels/processed_sampling_draw.py (sample, rank, finish); the design, the semantics and the
entry point in gpu_kernels/processed_sampling.py.

Every helper here is a device function; the Triton interpreter re-patches triton.language on each device call,
so the hot paths keep the nesting shallow (which changes nothing once compiled: device functions are inlined).
"""
from __future__ import annotations

import triton
import triton.language as tl

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
    grammar_word = tl.load(grammar_row_ptr + words, mask=tl.where(has_grammar != 0, mask, False), other=-1)
    seen_word = tl.load(seen_row_ptr + words, mask=tl.where(has_rep != 0, mask, False), other=0)
    output_word = tl.load(output_row_ptr + words, mask=tl.where(has_fp != 0, mask, False), other=0)
    return _process(x, cols, mask, grammar_word, seen_word, output_word, counts_row_ptr, rep, inv_rep, freq, pres,
                    inv_t, bias)


@triton.jit
def _process(x, cols, mask, grammar_word, seen_word, output_word, counts_row_ptr, rep, inv_rep, freq, pres, inv_t,
             bias):
    """`_pipeline` from the bitset words that hold each entry's bits (grammar -1, seen and output 0 where a step is
    off); only the counts of generated tokens are loaded here."""
    bit = cols & 31
    x = tl.where(((grammar_word >> bit) & 1) != 0, x, -float("inf")) + bias
    x = tl.where(((seen_word >> bit) & 1) != 0, tl.where(x > 0, x * inv_rep, x * rep), x)
    generated = (output_word >> bit) & 1
    count = tl.load(counts_row_ptr + cols, mask=mask & (generated != 0), other=0).to(tl.float32)
    x = (x - freq * count - pres * (count > 0).to(tl.float32)) * inv_t
    return tl.minimum(tl.where(x == x, x, -float("inf")), _FLT_MAX)


@triton.jit
def _load_raw(src, logits_row_ptr, scratch_row_ptr, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep,
              output_row_ptr, has_fp):
    """What y (see _load_y) is made from at `cols`, loaded: the float32 logits (the scratch row's y for `src` 2) and
    the grammar, seen and output bitset words its `src` reads (-1, 0 and 0 where not read). Apart from `_from_raw`
    so that a loop can issue the next block's loads before it processes this one."""
    if src == 2:
        x = tl.load(scratch_row_ptr + cols, mask=mask, other=-float("inf"))
    else:
        x = tl.load(logits_row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
    words = cols >> 5
    full = src == 3
    grammar_word = tl.load(grammar_row_ptr + words, mask=tl.where(full & (has_grammar != 0), mask, False), other=-1)
    seen_word = tl.load(seen_row_ptr + words, mask=tl.where(((src == 1) | full) & (has_rep != 0), mask, False),
                        other=0)
    output_word = tl.load(output_row_ptr + words, mask=tl.where(full & (has_fp != 0), mask, False), other=0)
    return x, grammar_word, seen_word, output_word


@triton.jit
def _from_raw(src, x, grammar_word, seen_word, output_word, cols, mask, counts_row_ptr, rep, inv_rep, freq, pres,
              inv_t):
    """The processed logits y (float32, -inf where `mask` is off) from `_load_raw`'s loads."""
    if src == 2:
        y = x
    elif src == 3:
        y = _process(x, cols, mask, grammar_word, seen_word, output_word, counts_row_ptr, rep, inv_rep, freq, pres,
                     inv_t, 0.0)
    elif src == 1:  # the --filtered mix: no grammar or count instructions at all
        x = tl.where(((seen_word >> (cols & 31)) & 1) != 0, tl.where(x > 0, x * inv_rep, x * rep), x) * inv_t
        y = tl.minimum(tl.where(x == x, x, -float("inf")), _FLT_MAX)
    else:
        x = x * inv_t
        y = tl.minimum(tl.where(x == x, x, -float("inf")), _FLT_MAX)
    return y


@triton.jit
def _load_y(src, logits_row_ptr, scratch_row_ptr, cols, mask, grammar_row_ptr, has_grammar, seen_row_ptr, has_rep,
            rep, inv_rep, output_row_ptr, counts_row_ptr, has_fp, freq, pres, inv_t):
    """The processed logits y (float32, -inf where `mask` is off) of one row at `cols` (`src`: see _row)."""
    x, grammar_word, seen_word, output_word = _load_raw(src, logits_row_ptr, scratch_row_ptr, cols, mask,
                                                        grammar_row_ptr, has_grammar, seen_row_ptr, has_rep,
                                                        output_row_ptr, has_fp)
    return _from_raw(src, x, grammar_word, seen_word, output_word, cols, mask, counts_row_ptr, rep, inv_rep, freq,
                     pres, inv_t)


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


@triton.jit
def _active_tile_raw(maxima, hit, rank, i, n_hit, chunk, src, logits_row_ptr, scratch_row_ptr, grammar_row_ptr,
                     has_grammar, seen_row_ptr, has_rep, output_row_ptr, has_fp, vocab_size, TILE: tl.constexpr,
                     NTC: tl.constexpr):
    """The i-th active tile of the chunk (`_chunk_tiles`): its columns `[TILE]`, its max and `_load_raw`'s loads,
    all masked off when i >= n_hit. A loop over the active tiles calls this for tile i + 1 before it processes
    tile i, so that the next tile's loads are in flight meanwhile."""
    tile, tile_max = _nth_tile(maxima, hit, rank, i, chunk, NTC)
    cols = tile * TILE + tl.arange(0, TILE)
    x, grammar_word, seen_word, output_word = _load_raw(src, logits_row_ptr, scratch_row_ptr, cols,
                                                        tl.where(i < n_hit, cols < vocab_size, False),
                                                        grammar_row_ptr, has_grammar, seen_row_ptr, has_rep,
                                                        output_row_ptr, has_fp)
    return cols, tile_max, x, grammar_word, seen_word, output_word


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
