"""One fused sampler for every row of a step: plain rows (temperature only) and "processed" rows (top-k, top-p,
min-p, repetition/frequency/presence penalties, logit bias and bans, a grammar bitmask, logprobs), with no sort
of the vocabulary and a fixed sequence of launches, so a decode step's CUDA graph can hold it.

Semantics (those of workers/logits_processing.py + workers/sampler.py; `processed_sampling_reference.py` is
the executable definition). For row r and token i, float32 throughout:
  1. grammar: a token whose bit is 0 in the row's packed bitmask gets -inf;
  2. sparse entries: bias added, then bans (-inf), the latter possibly conditional on the last sampled token;
  3. repetition (seen in prompt or output): x > 0 ? x * (1/rep) : x * rep;
  4. frequency/presence: x - freq * count - pres * (count > 0);
  5. temperature: y = x * (1/T) (1 for greedy rows). 1/T and 1/rep are rounded once on the host; this differs
     from a true division by at most one ulp of y;
  NaN becomes -inf and +inf the largest float, so NaN never wins and +inf entries tie at the top.
  6. kept set {y >= tau}, tau = max(tau_k, tau_p, tau_min): tau_k the k-th largest y (ties kept); tau_p the
     largest value v >= tau_k whose upper set {y >= v} holds at least p of the mass of {y >= tau_k} (the same
     set as "keep a token iff the mass strictly above it is below p times the mass of the top-k set"; ties kept
     or dropped together, the top token always kept; p >= 1 is off); tau_min = max(y) + log(min_p). Greedy
     rows use no filter.
  7. token: greedy rows take the first argmax of y; the others the first argmax over the kept set of
     y - log(-log(u_i)) with u_i the Philox4x32-10 uniform gpu_kernels/sampling.py uses for (seed, i), so a
     plain row gets exactly `sample_candidates`' token (it runs that module's own chunk scan). A row with no
     finite logit gets token 0.
  8. logprobs (rows with N >= 0): y_token - logsumexp(kept y), the rank (1 + kept tokens with a strictly larger
     y), the N most likely kept tokens (ties: lowest id first); slots past the kept set get -inf and the lowest
     ids not listed before them.

Design. The vocabulary is split into chunks (grid `(rows, chunks)`, at least 2048 entries each) of tiles of
TILE (256) entries; the kernels are in gpu_kernels/processed_sampling_kernels.py (prepare to resolve) and
gpu_kernels/processed_sampling_draw.py (sample to finish), their helpers in processed_sampling_device.py:
  prepare   rows with sparse entries: their processed logits y go to a float32 scratch row (bias before the
            penalties, as step 2 requires), which later passes read instead of the logits; then every row
            that filters or reports logprobs writes per-tile max, min, sum of exp(y - tile max) and finite count.
  plan      (one program a row) the row's max M, mass Z = sum exp(y - M), finite count, min and tau_min; the
            initial brackets of its two searches from the sorted tile maxima (the k-th largest tile max has at
            least k entries at or above it; for top-p the tile maxima whose masses add up to p * Z).
  pivot x NUM_PASSES   each program reads its row's previous partials, narrows each bracket [lo, hi) to the
            sub-bracket between two of the PIVOTS pivots where the count (top-k, top-N) or mass (top-p) crosses
            the target, and evaluates the new pivots, visiting only tiles whose max reaches the bracket.
            Search A is the threshold (top-k, top-p, or top-k then top-p), search B the top-N of logprobs.
            A search stops when its bracket holds one distinct value (exact), or few enough entries to collect.
  collect   the entries of each ready bracket go to a per-row buffer, in index order: slots come from the
            per-chunk counts of the last pass (no atomics; deterministic).
  resolve   (one program a row) sorts each buffer (tl.sort of (value, index) keys) and reads the exact
            threshold, or the top N, off it; tau = max(tau_A, tau_min).
  sample    Gumbel-max (or argmax) over {y >= tau}, only in tiles whose max reaches tau; the kept mass for
            logprob rows. Plain rows run gpu_kernels.sampling._chunk_best over the whole chunk.
  rank      each row's token from the chunk winners (ties: lowest index); for logprob rows the count of kept
            entries above the token, again only in tiles whose max exceeds it.
  finish    (one program a row) logprob, rank and the top-N logprobs.
Rows with nothing to do in a pass leave by a scalar branch, so a plain row costs what sample_candidates costs;
a batch of plain rows only still pays the idle launches (about 3 us each on an H200, an estimate), so the engine
may keep calling sample_candidates for steps without processed rows.

Ties and overflow. Every comparison is on values, so tied tokens are always kept or dropped together. A bracket
that still holds more than its buffer (CAP_A entries for the threshold, CAP_B - SEG1 for the top-N) after the
last pass and more than one distinct value is rounded: the threshold keeps the whole bracket (tau = its lower
end); for top-N the buffer keeps the lowest indices. Both set a bit of `flags` (1: threshold rounded, 2: top-N
inexact) and add 1 to `ProcessedSamplingWorkspace.overflow_count` (the sampler's only atomic, tl.atomic_add).
A top-k followed by top-p whose top-k set is larger than CAP_A (1024) has its top-k threshold narrowed to a
single value first and its top-p threshold searched in the passes left (about 6 passes in all on bf16 rows);
with fewer, its current bracket is kept whole (flag 1).

Cost (estimates for batch 256, vocabulary 151,936, bf16; not yet measured, see benchmarks/sampling_bench.py).
The prepare pass reads every processed row once: 2 B of logits + 1/8 B per penalty bitset + 1/16 B of tile
statistics written per entry, and 20-35 operations per entry (the y pipeline, then max/min/count/exp-sum), so
it is compute-bound at roughly 40-70 us. Every later pass visits only tiles whose max reaches its bracket: for
top-k 50-like rows about 10% of the tiles in the first pivot pass (16 compares and adds per search per entry,
plus a select, add and exp for top-p) and a few % in collect, sample (with Philox) and rank, each pass a few
to 20 us, mostly latency; settled passes exit after a few scalar loads (~3 us a launch). Rows whose kept set is
most of the vocabulary (no filter with logprobs or penalties, a flat top-p) read whole rows in ~2 pivot passes
(60-90 operations per entry) and in the sample pass (~45, Philox as in sample_candidates).

Sources: the Gumbel-max trick (Gumbel 1954; Maddison, Tarlow & Minka 2014); Philox4x32-10 (Salmon et al., SC
2011); pivot-based thresholds without a sort after FlashInfer's sorting-free top-k/top-p sampling (Ye et al.,
FlashInfer, 2025). Tensor parallelism is out of scope: rows processed here need the whole vocabulary (the
engine gathers it for them when TP > 1); plain rows may keep using sample_candidates on each rank's slice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton

from gpu_kernels.pdl import launch_options, pdl_for
from gpu_kernels.processed_sampling_device import (
    DEFAULT_CAP_A,
    DEFAULT_CAP_B,
    DEFAULT_NUM_PASSES,
    DEFAULT_TILE,
    MAX_TOP,
    PIVOTS,
    SEG1,
    STATE_WIDTH,
)
from gpu_kernels.processed_sampling_draw import _finish_kernel, _rank_kernel, _sample_kernel
from gpu_kernels.processed_sampling_kernels import (
    _collect_kernel,
    _pivot_kernel,
    _plan_kernel,
    _prepare_kernel,
    _resolve_kernel,
)
from gpu_kernels.sampling import choose_chunk_size
from gpu_kernels.sampling_inputs import (
    I_GRAMMAR_ROW,
    I_SCRATCH_ROW,
    I_STATE_ROW,
    PenaltyBits,
    ProcessedParams,
    SparseEntries,
)

_MIN_CHUNK = 2048  # chunks of at least this many entries: fewer partials for each program to read
_ENTRY_BLOCK = 64  # sparse entries a prepare program handles at once
_SMALL_SORT = 256  # a threshold bracket of at most this many entries is sorted at this size, not CAP_A
_FIELD_ALIGN = 16  # bytes: where each output field starts in ProcessedSample.packed
# Each kernel's launch options (Triton's num_warps and num_stages), and for the kernels that sweep whole chunks the
# entries one iteration covers (prepare's tiles a pass, sample's and rank's dense blocks). Fixed for the engine;
# benchmarks/sampling_bench.py's --launch overrides them to compare settings on a GPU. Any setting gives the same
# result.
LAUNCH: dict[str, dict[str, int]] = {
    "prepare": {"num_warps": 4}, "plan": {"num_warps": 4}, "pivot": {"num_warps": 4}, "collect": {"num_warps": 4},
    "resolve": {"num_warps": 4}, "sample": {"num_warps": 4}, "rank": {"num_warps": 4}, "finish": {"num_warps": 1},
}
BLOCK: dict[str, int] = {"prepare": 1024, "sample": 1024, "rank": 1024}

__all__ = ["MAX_TOP", "SEG1", "ProcessedSample", "ProcessedSamplingWorkspace", "choose_processed_chunk_size",
           "compile_for_batches", "processed_chunk_representatives", "processed_sample"]


# ============================================================================ host side
@dataclass
class ProcessedSample:
    """What `processed_sample` returns for n rows (every tensor on the logits' device), each field a view of one
    byte buffer, `packed`, so that one copy takes them all to the host (`to_host`)."""

    tokens: torch.Tensor  # [n] int64
    logprobs: torch.Tensor  # [n] float32: the token's logprob over the kept set; 0 for rows that did not ask
    ranks: torch.Tensor  # [n] int64: 1 + kept tokens strictly more likely; 0 for rows that did not ask
    top_logprobs: torch.Tensor  # [n, num_top] float32, most likely first; -inf past the kept set or the row's N
    top_ids: torch.Tensor  # [n, num_top] int64
    thresholds: torch.Tensor  # [n] float32: tau, the row keeps {y >= tau} (-inf: every finite token)
    flags: torch.Tensor  # [n] int32: 1 threshold rounded (bracket kept whole), 2 top-N inexact; 0 normally
    packed: torch.Tensor  # [bytes] uint8: the fields above, one after the other (`carve`'s layout)

    # (field, dtype, columns: 1 or num_top), the 8-byte ones first so that every field starts aligned
    LAYOUT = (("tokens", torch.int64, 1), ("ranks", torch.int64, 1), ("top_ids", torch.int64, "top"),
              ("logprobs", torch.float32, 1), ("top_logprobs", torch.float32, "top"),
              ("thresholds", torch.float32, 1), ("flags", torch.int32, 1))

    @classmethod
    def carve(cls, packed: torch.Tensor | None, n: int, num_top: int, device: torch.device | str = "cpu"
              ) -> ProcessedSample:
        """The fields of n rows as views of `packed` (uint8, `nbytes(n, num_top)` long; None: a new buffer on
        `device`)."""
        if packed is None:
            packed = torch.empty(cls.nbytes(n, num_top), dtype=torch.uint8, device=device)
        fields = {}
        for (name, dtype, columns), (offset, size) in zip(cls.LAYOUT, cls._extents(n, num_top)):
            view = packed[offset: offset + size].view(dtype)
            fields[name] = view.view(n, num_top) if columns == "top" else view
        return cls(**fields, packed=packed)

    @classmethod
    def _extents(cls, n: int, num_top: int) -> list[tuple[int, int]]:
        """(byte offset, bytes) of each field. Every field starts on a multiple of 16 bytes: Triton specializes a
        kernel on whether each pointer is 16-byte aligned, and offsets that followed n would compile new variants
        of the kernels mid-run (they did: `_finish_kernel` at the first odd batch)."""
        extents, offset = [], 0
        for _, dtype, columns in cls.LAYOUT:
            size = n * (num_top if columns == "top" else 1) * dtype.itemsize
            extents.append((offset, size))
            offset += -(-size // _FIELD_ALIGN) * _FIELD_ALIGN
        return extents

    @classmethod
    def nbytes(cls, n: int, num_top: int) -> int:
        offset, size = cls._extents(n, num_top)[-1]
        return offset + size

    def to_host(self) -> ProcessedSample:
        """Start one copy of every field to pinned host memory (CUDA; read it after an event recorded later on
        this stream); on a CPU the sample itself."""
        if not self.packed.is_cuda:
            return self
        host = torch.empty(self.packed.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(self.packed, non_blocking=True)
        return ProcessedSample.carve(host, self.tokens.shape[0], self.top_ids.shape[1])


class ProcessedSamplingWorkspace:
    """Device buffers of `processed_sample`, allocated once per (rows, chunks) and reused, so a captured CUDA
    graph keeps valid addresses: the float32 scratch `[max_scratch_rows, vocab]` (rows with sparse entries),
    per-tile statistics `[rows, ceil(vocab / tile)]` x 4, the search states and per-chunk partials
    (`num_passes + 2` states, `[num_passes + 1, rows, chunks, 2, PIVOTS]` counts and masses) and the per-row
    buffers (CAP_A and CAP_B entries). `overflow_count` `[1]` int64 counts rows that needed a documented rounding.

    `tile_size` (a power of two >= 16) is the granularity at which passes skip the vocabulary and `num_passes`
    (>= 1) the number of pivot passes; `threshold_capacity` (CAP_A) and `top_capacity` (CAP_B) the per-row
    buffers of the threshold and top-N brackets (powers of two >= 64): all fixed here because they shape the
    buffers (smaller buffers make the interpreter faster; on the GPU the defaults).
    """

    def __init__(self, device: torch.device | str, vocab_size: int, *, max_scratch_rows: int = 0,
                 tile_size: int = DEFAULT_TILE, num_passes: int = DEFAULT_NUM_PASSES,
                 threshold_capacity: int = DEFAULT_CAP_A, top_capacity: int = DEFAULT_CAP_B) -> None:
        if tile_size < 16 or tile_size & (tile_size - 1):
            raise ValueError(f"tile_size must be a power of two >= 16, got {tile_size}")
        if num_passes < 1:
            raise ValueError(f"num_passes must be >= 1, got {num_passes}")
        for cap in (threshold_capacity, top_capacity):
            if cap < 2 * SEG1 or cap & (cap - 1):
                raise ValueError(f"buffer capacities must be powers of two >= {2 * SEG1}, got {cap}")
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.tile_size = tile_size
        self.num_passes = num_passes
        self.cap_a, self.cap_b = threshold_capacity, top_capacity
        self.num_tiles = triton.cdiv(vocab_size, tile_size)
        self.scratch = torch.empty(max(1, max_scratch_rows), vocab_size, dtype=torch.float32, device=self.device)
        self.max_scratch_rows = max_scratch_rows
        self.overflow_count = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def buffers(self, rows: int, num_chunks: int) -> dict[str, torch.Tensor]:
        """The buffers for `rows` rows split into `num_chunks` chunks (allocated on first use)."""
        key = (rows, num_chunks)
        if key not in self._buffers:
            dev, f32, i32 = self.device, torch.float32, torch.int32
            states = (self.num_passes + 2, rows, 2, STATE_WIDTH)
            partials = (self.num_passes + 1, rows, num_chunks, 2, PIVOTS)
            self._buffers[key] = {
                "tile_max": torch.empty(rows, self.num_tiles, dtype=f32, device=dev),
                "tile_min": torch.empty(rows, self.num_tiles, dtype=f32, device=dev),
                "tile_sum": torch.empty(rows, self.num_tiles, dtype=f32, device=dev),
                "tile_cnt": torch.empty(rows, self.num_tiles, dtype=i32, device=dev),
                "state_f": torch.zeros(states, dtype=f32, device=dev),
                "state_i": torch.zeros(states, dtype=i32, device=dev),
                "row": torch.zeros(rows, STATE_WIDTH, dtype=f32, device=dev),
                # Zeroed: a pass reads only partials its searches wrote, but never uninitialised memory.
                "cnt": torch.zeros(partials, dtype=i32, device=dev),
                "mass": torch.zeros(partials, dtype=f32, device=dev),
                "ext": torch.zeros(self.num_passes + 1, rows, num_chunks, 2, 2, dtype=f32, device=dev),
                "val_a": torch.empty(rows, self.cap_a, dtype=f32, device=dev),
                "id_a": torch.empty(rows, self.cap_a, dtype=i32, device=dev),
                "val_b": torch.empty(rows, self.cap_b, dtype=f32, device=dev),
                "id_b": torch.empty(rows, self.cap_b, dtype=i32, device=dev),
                "top_v": torch.empty(rows, MAX_TOP, dtype=f32, device=dev),
                "top_id": torch.empty(rows, MAX_TOP, dtype=i32, device=dev),
                "flags": torch.empty(rows, dtype=i32, device=dev),
                "best_score": torch.empty(rows, num_chunks, dtype=f32, device=dev),
                "best_index": torch.empty(rows, num_chunks, dtype=i32, device=dev),
                "best_y": torch.empty(rows, num_chunks, dtype=f32, device=dev),
                "kept_mass": torch.empty(rows, num_chunks, dtype=f32, device=dev),
                "rank": torch.empty(rows, num_chunks, dtype=i32, device=dev),
            }
        return self._buffers[key]


def choose_processed_chunk_size(rows: int, vocab: int, num_sms: int, tile_size: int = DEFAULT_TILE) -> int:
    """Vocabulary entries per program: gpu_kernels/sampling.py's choice, but at least _MIN_CHUNK (each program
    of a pass reads all of its row's per-chunk partials) and at least one tile. Any choice gives the same
    result."""
    return max(tile_size, min(max(_MIN_CHUNK, choose_chunk_size(rows, vocab, num_sms)),
                              triton.next_power_of_2(vocab)))


def processed_chunk_representatives(max_rows: int, vocab: int, num_sms: int, tile_size: int = DEFAULT_TILE
                                    ) -> list[int]:
    """The smallest row count of each distinct `choose_processed_chunk_size` over 1..`max_rows` rows: every
    compile-time constant of the kernels follows from the chunk size (and the workspace), so one call at each
    compiles what any batch of up to `max_rows` rows needs."""
    firsts: dict[int, int] = {}
    for rows in range(1, max_rows + 1):
        firsts.setdefault(choose_processed_chunk_size(rows, vocab, num_sms, tile_size), rows)
    return sorted(firsts.values())


def compile_for_batches(max_rows: int, dtype: torch.dtype, workspace: ProcessedSamplingWorkspace,
                        num_top: int = 0) -> None:
    """Compile `processed_sample` for every batch of 1..`max_rows` rows of `dtype` logits (a compile holds a step
    for a second or so; call this at start-up). The row types take scalar branches inside the same kernels, so
    one batch of any rows compiles them all. A CUDA graph of n rows still needs one eager call at n first, which
    allocates that batch's buffers in the workspace."""
    device, vocab = workspace.device, workspace.vocab_size
    for rows in processed_chunk_representatives(max_rows, vocab, _num_sms(device), workspace.tile_size):
        params = ProcessedParams.from_arrays(np.ones(rows, np.float32), vocab, device, top_k=np.ones(rows),
                                             num_logprobs=np.full(rows, num_top))
        processed_sample(torch.zeros(rows, vocab, dtype=dtype, device=device), params,
                         torch.zeros(rows, dtype=torch.int64, device=device), workspace=workspace, num_top=num_top)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def processed_sample(
    logits: torch.Tensor,
    params: ProcessedParams,
    seeds: torch.Tensor,
    *,
    workspace: ProcessedSamplingWorkspace | None = None,
    penalties: PenaltyBits | None = None,
    bitmask: torch.Tensor | None = None,
    sparse: SparseEntries | None = None,
    last_sampled: torch.Tensor | None = None,
    num_top: int = 0,
    chunk_size: int | None = None,
) -> ProcessedSample:
    """Sample one token per row with every filter, penalty and logprob of its parameters, in 7 + num_passes
    launches whatever the mix of rows, with no host synchronisation (capturable in a CUDA graph).

    Args:
        logits: `[n, vocab]` bf16, fp16 or fp32, last-dimension stride 1: the whole vocabulary.
        params: the rows' `ProcessedParams` (n rows).
        seeds: `[n]` int64 Philox seeds (ignored for greedy rows): the same seed gives the same token, and a
            plain row the token `gpu_kernels.sampling.sample_candidates` gives.
        workspace: reused device buffers; None allocates a fresh one (not for graph capture). Rows with sparse
            entries need `max_scratch_rows` above their scratch row.
        penalties: the token state of rows with a repetition, frequency or presence penalty (their I_STATE_ROW).
        bitmask: `[G, ceil(vocab / 32)]` int32, the grammar rows' allowed tokens (their I_GRAMMAR_ROW).
        sparse: bias and bans (rows with an I_SCRATCH_ROW).
        last_sampled: `[max_num_seqs]` int64, each state row's last sampled token (conditional bans).
        num_top: width of the top-N outputs (<= MAX_TOP); rows asking for more get the first num_top.
        chunk_size: vocabulary entries per program (a power of two, a multiple of the workspace's tile size);
            None picks `choose_processed_chunk_size`. It changes the speed, never the result.

    Returns:
        `ProcessedSample`. A row with no finite logit gets token 0 (logprob -inf, rank 1).

    Raises:
        ValueError: on mismatched shapes, a vocabulary other than the workspace's, a bad chunk size or
            num_top, or (checked on the host copy of the parameters) a row naming a grammar, scratch or
            penalty row that the inputs do not provide.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [n, vocab] with a contiguous vocabulary dimension")
    n, vocab = logits.shape
    if params.num_rows != n or seeds.shape != (n,):
        raise ValueError(f"params and seeds must describe {n} rows, got {params.num_rows} and {tuple(seeds.shape)}")
    if not 0 <= num_top <= MAX_TOP:
        raise ValueError(f"num_top must lie in [0, {MAX_TOP}], got {num_top}")
    ws = workspace or ProcessedSamplingWorkspace(logits.device, vocab, max_scratch_rows=n)
    if ws.vocab_size != vocab:
        raise ValueError(f"the workspace is for a vocabulary of {ws.vocab_size}, the logits have {vocab}")
    tile = ws.tile_size
    if chunk_size is None:
        chunk_size = choose_processed_chunk_size(n, vocab, _num_sms(logits.device), tile)
    elif chunk_size < tile or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= the tile size {tile}, got {chunk_size}")
    _check_references(params, ws, penalties, bitmask, sparse)
    out = ProcessedSample.carve(None, n, num_top, logits.device)
    tokens = out.tokens
    if not n:
        return out
    num_chunks = triton.cdiv(vocab, chunk_size)
    b = ws.buffers(n, num_chunks)
    num_words = triton.cdiv(vocab, 32)
    dummy_i32 = b["flags"]
    seen, output, counts = penalties.tensors() if penalties is not None else (dummy_i32, dummy_i32, dummy_i32)
    grammar = bitmask if bitmask is not None else dummy_i32
    if sparse is None:
        entries = (torch.zeros(n + 1, dtype=torch.int32, device=logits.device), dummy_i32, b["best_score"],
                   torch.full((1,), -2, dtype=torch.int64, device=logits.device))
    else:
        entries = (sparse.offsets, sparse.tokens, sparse.bias, sparse.ban_after)
    last = last_sampled if last_sampled is not None else tokens
    fp, ip = params.floats, params.ints
    grid, rows = (n, num_chunks), (n,)
    ch = max(2, triton.next_power_of_2(num_chunks))
    nt = max(2, triton.next_power_of_2(ws.num_tiles))
    tpb = max(1, min(chunk_size, BLOCK["prepare"]) // tile)
    common = (logits, logits.stride(0), fp, ip)
    inputs = (ws.scratch, grammar, seen, output, counts)
    tiles = (b["tile_max"], b["tile_min"], b["tile_sum"], b["tile_cnt"])
    searches = (b["state_f"], b["state_i"], b["row"], b["cnt"], b["mass"], b["ext"])
    pdl = pdl_for(logits)  # every launch below waits for the one before inside the kernel (gpu_kernels/pdl.py)
    launch = launch_options(pdl)
    _prepare_kernel[grid](*common, *inputs, *entries, last, int(last_sampled is not None), *tiles, vocab, num_words,
                          ws.num_tiles, CHUNK=chunk_size, TILE=tile, TPB=tpb, EB=_ENTRY_BLOCK, **LAUNCH["prepare"],
                          PDL=pdl, **launch)
    _plan_kernel[rows](fp, ip, *tiles, b["state_f"], b["state_i"], b["row"], n, ws.num_tiles, NT=nt, **LAUNCH["plan"],
                       PDL=pdl, **launch)
    for pass_index in range(1, ws.num_passes + 1):
        _pivot_kernel[grid](*common, *inputs, b["tile_max"], *searches, pass_index, n, num_chunks, vocab, num_words,
                            ws.num_tiles, CHUNK=chunk_size, TILE=tile, CH=ch, CAP_A=ws.cap_a, CAP_B=ws.cap_b,
                            **LAUNCH["pivot"], PDL=pdl, **launch)
    _collect_kernel[grid](*common, *inputs, b["tile_max"], *searches, b["val_a"], b["id_a"], b["val_b"], b["id_b"],
                          ws.num_passes, n, num_chunks, vocab, num_words, ws.num_tiles, CHUNK=chunk_size, TILE=tile,
                          CH=ch, CAP_A=ws.cap_a, CAP_B=ws.cap_b, **LAUNCH["collect"], PDL=pdl, **launch)
    _resolve_kernel[rows](fp, ip, b["state_f"], b["state_i"], b["row"], b["val_a"], b["id_a"], b["val_b"], b["id_b"],
                          b["top_v"], b["top_id"], b["flags"], ws.num_passes + 1, n, NB=MAX_TOP, CAP_A=ws.cap_a,
                          CAP_B=ws.cap_b, SMALL_A=min(_SMALL_SORT, ws.cap_a), **LAUNCH["resolve"], PDL=pdl, **launch)
    partials = (b["best_score"], b["best_index"], b["best_y"], b["kept_mass"])
    _sample_kernel[grid](*common, seeds, *inputs, b["tile_max"], b["row"], *partials, num_chunks, vocab, num_words,
                         ws.num_tiles, CHUNK=chunk_size, TILE=tile,
                         BLOCK_V=min(BLOCK["sample"], chunk_size), **LAUNCH["sample"], PDL=pdl, **launch)
    _rank_kernel[grid](*common, *inputs, b["tile_max"], b["row"], *partials, b["rank"], tokens, num_chunks, vocab,
                       num_words, ws.num_tiles, CHUNK=chunk_size, TILE=tile, CH=ch,
                       BLOCK_V=min(BLOCK["rank"], chunk_size), **LAUNCH["rank"], PDL=pdl, **launch)
    _finish_kernel[rows](ip, b["row"], b["rank"], b["top_v"], b["top_id"], b["flags"], ws.overflow_count,
                         out.logprobs, out.ranks, out.top_logprobs, out.top_ids, out.thresholds, out.flags,
                         num_chunks, num_top, CH=ch, NB=MAX_TOP, **LAUNCH["finish"], PDL=pdl, **launch)
    return out


def _check_references(params: ProcessedParams, ws: ProcessedSamplingWorkspace, penalties: PenaltyBits | None,
                      bitmask: torch.Tensor | None, sparse: SparseEntries | None) -> None:
    """Refuse rows that name tensors the call does not pass (only when the host copy of the params exists)."""
    h = params.host_ints
    if h is None:
        return
    grammar, scratch, state = h[:, I_GRAMMAR_ROW], h[:, I_SCRATCH_ROW], h[:, I_STATE_ROW]
    if (grammar >= 0).any() and (bitmask is None or grammar.max() >= bitmask.shape[0]):
        raise ValueError("a row names a grammar bitmask row that the bitmask does not have")
    if (scratch >= 0).any() and (sparse is None or scratch.max() >= ws.max_scratch_rows):
        raise ValueError("a row names a scratch row: pass its sparse entries and a workspace with enough scratch rows")
    if penalties is None and params.penalized_rows().any():
        raise ValueError("rows with penalties need their PenaltyBits")
    if penalties is not None and (state >= penalties.max_num_seqs).any():
        raise ValueError("a row names a penalty state row outside the PenaltyBits")
