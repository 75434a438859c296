"""Inputs of the processed-row sampler (gpu_kernels/processed_sampling.py): per-row parameters, sparse
(row, token) entries and the penalty state, in the static layouts a CUDA graph can replay.

- `ProcessedParams`: every per-row parameter of a step in two packed tensors, `floats [n, 8]` float32 and
  `ints [n, 8]` int32 (columns `F_*` and `I_*` below), so one copy a step refreshes a captured graph's inputs.
- `SparseEntries`: logit bias and bans as a CSR over the rows, one entry per (row, token) (several only for
  bans conditional on different last tokens), built on the host from `ProcessingInputs`-like arrays.
- `PenaltyBits`: the tokens a request has seen (prompt and output) and generated, as packed bitsets
  `[max_num_seqs, ceil(V / 32)]` int32 (token t is bit t % 32 of word t // 32, the grammar bitmask's packing)
  plus output counts `[max_num_seqs, V]` int32 that the sampler reads only where the output bit is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_kernels.pdl import launch_options, pdl_for, wait_then_release

# Columns of ProcessedParams.floats.
F_TEMPERATURE = 0  # 0: greedy (argmax, no filter), else the divisor of the logits
F_INV_TEMPERATURE = 1  # 1 / T rounded once on the host (1 for greedy rows): the kernels multiply by it
F_TOP_P = 2  # 1: off
F_MIN_P = 3  # 0: off
F_REPETITION = 4  # 1: off
F_INV_REPETITION = 5  # 1 / repetition, rounded once on the host
F_FREQUENCY = 6
F_PRESENCE = 7
NUM_FLOAT_COLUMNS = 8
# Columns of ProcessedParams.ints.
I_TOP_K = 0  # 0: off
I_STATE_ROW = 1  # the request's row of PenaltyBits and of `last_sampled`; -1: none (no penalties apply)
I_GRAMMAR_ROW = 2  # row of the grammar bitmask; -1: unconstrained
I_SCRATCH_ROW = 3  # row of the float32 scratch that holds the row's processed logits; -1: none (no sparse entries)
I_NUM_LOGPROBS = 4  # N >= 0: the sampled token's logprob, its rank and the top N; -1: none
NUM_INT_COLUMNS = 8

BAN_NONE = -2  # SparseEntries.ban_after: the entry only adds its bias
BAN_ALWAYS = -1  # the token is banned; a value t >= 0 bans it only if the row's last sampled token is t


@dataclass
class ProcessedParams:
    """Per-row sampling parameters of n rows, on the device.

    `floats` `[n, 8]` float32 and `ints` `[n, 8]` int32 hold the columns F_* and I_*; `host_floats` and
    `host_ints` keep the host copies (when built on the host) so that `processed_sample` can refuse a row that
    names a grammar, scratch or penalty row with no tensor behind it without reading the device.
    """

    floats: torch.Tensor
    ints: torch.Tensor
    host_floats: np.ndarray | None = None
    host_ints: np.ndarray | None = None

    def penalized_rows(self) -> np.ndarray:
        """`[n]` bool on the host: rows whose repetition, frequency or presence penalty applies (needs the
        host copies)."""
        assert self.host_floats is not None and self.host_ints is not None
        f, i = self.host_floats, self.host_ints
        return (i[:, I_STATE_ROW] >= 0) & ((f[:, F_REPETITION] != 1) | (f[:, F_FREQUENCY] != 0)
                                           | (f[:, F_PRESENCE] != 0))

    @property
    def num_rows(self) -> int:
        return self.floats.shape[0]

    @classmethod
    def from_arrays(cls, temperature: np.ndarray, vocab_size: int, device: torch.device | str,
                    **columns: np.ndarray | None) -> ProcessedParams:
        """`pack` the `[n]` host arrays and upload them (the keyword arguments are `pack`'s)."""
        floats, ints = cls.pack(temperature, vocab_size, **columns)
        return cls(_upload(floats, device), _upload(ints, device), floats, ints)

    @staticmethod
    def pack(temperature: np.ndarray, vocab_size: int, *, top_k: np.ndarray | None = None,
             top_p: np.ndarray | None = None, min_p: np.ndarray | None = None, repetition: np.ndarray | None = None,
             frequency: np.ndarray | None = None, presence: np.ndarray | None = None,
             state_rows: np.ndarray | None = None, grammar_rows: np.ndarray | None = None,
             scratch_rows: np.ndarray | None = None, num_logprobs: np.ndarray | None = None,
             ) -> tuple[np.ndarray, np.ndarray]:
        """Pack `[n]` host arrays (None: the parameter is off for every row) into the host tables
        `floats [n, 8]` float32 and `ints [n, 8]` int32.

        Greedy rows (temperature <= 0) get no filter (top_k 0, top_p 1, min_p 0), as
        workers/logits_processing.py's `build_processing` does, and top_k >= vocab_size is off.
        Raises ValueError on arrays of another length or a temperature, top_p or min_p out of range.
        """
        t = np.asarray(temperature, dtype=np.float32)
        n = t.shape[0]

        def column(values: np.ndarray | None, default: float, dtype: type) -> np.ndarray:
            if values is None:
                return np.full(n, default, dtype=dtype)
            a = np.asarray(values, dtype=dtype)
            if a.shape != (n,):
                raise ValueError(f"per-row parameters must be [{n}], got {a.shape}")
            return a

        greedy = t <= 0
        k = column(top_k, 0, np.int64)
        p, mp = column(top_p, 1.0, np.float32), column(min_p, 0.0, np.float32)
        if ((p < 0) | (p > 1)).any() or ((mp < 0) | (mp > 1)).any() or np.isnan(t).any():
            raise ValueError("top_p and min_p must lie in [0, 1] and temperatures must not be NaN")
        rep = column(repetition, 1.0, np.float32)
        if (rep <= 0).any():
            raise ValueError("repetition penalties must be > 0")
        floats = np.zeros((n, NUM_FLOAT_COLUMNS), dtype=np.float32)
        floats[:, F_TEMPERATURE] = np.where(greedy, 0.0, t)
        floats[:, F_INV_TEMPERATURE] = np.float32(1.0) / np.where(greedy, np.float32(1.0), t)
        floats[:, F_TOP_P] = np.where(greedy, 1.0, p)
        floats[:, F_MIN_P] = np.where(greedy, 0.0, mp)
        floats[:, F_REPETITION] = rep
        floats[:, F_INV_REPETITION] = np.float32(1.0) / rep
        floats[:, F_FREQUENCY] = column(frequency, 0.0, np.float32)
        floats[:, F_PRESENCE] = column(presence, 0.0, np.float32)
        ints = np.zeros((n, NUM_INT_COLUMNS), dtype=np.int32)
        ints[:, I_TOP_K] = np.where(greedy | (k <= 0) | (k >= vocab_size), 0, k)
        ints[:, I_STATE_ROW] = column(state_rows, -1, np.int32)
        ints[:, I_GRAMMAR_ROW] = column(grammar_rows, -1, np.int32)
        ints[:, I_SCRATCH_ROW] = column(scratch_rows, -1, np.int32)
        ints[:, I_NUM_LOGPROBS] = column(num_logprobs, -1, np.int32)
        return floats, ints

    def copy_(self, other: ProcessedParams) -> ProcessedParams:
        """Copy `other`'s values into these tensors (same n), e.g. the static inputs of a captured graph."""
        self.floats.copy_(other.floats, non_blocking=True)
        self.ints.copy_(other.ints, non_blocking=True)
        self.host_floats, self.host_ints = other.host_floats, other.host_ints
        return self


@dataclass
class SparseEntries:
    """Logit bias and bans of n rows as a CSR on the device.

    Row r's entries are `offsets[r] .. offsets[r + 1] - 1` of `tokens` `[E]` int32, `bias` `[E]` float32 (added
    to the logit) and `ban_after` `[E]` int64 (BAN_NONE, BAN_ALWAYS, or a token id: banned only if the row's
    last sampled token is that id). A row's entries are sorted by token and a token appears once, except
    that a token banned under several conditions repeats with the same bias. Rows with entries need a scratch
    row (`ProcessedParams` column I_SCRATCH_ROW); `scratch_rows` `[n]` int32 numbers them 0, 1, ... (-1: none).
    """

    offsets: torch.Tensor
    tokens: torch.Tensor
    bias: torch.Tensor
    ban_after: torch.Tensor
    scratch_rows: np.ndarray

    @property
    def num_scratch_rows(self) -> int:
        return int((self.scratch_rows >= 0).sum())

    @classmethod
    def from_lists(cls, num_rows: int, device: torch.device | str, **lists: Sequence[int] | Sequence[float]
                   ) -> SparseEntries:
        """`merge` the (row, token) lists and upload the CSR (the keyword arguments are `merge`'s)."""
        return cls.upload(cls.merge(num_rows, **lists), device)

    @classmethod
    def upload(cls, h: SparseHost, device: torch.device | str) -> SparseEntries:
        """The host CSR `h` on `device`."""
        pad = 0 if len(h.tokens) else 1  # an empty CSR still passes valid (one-element) buffers to the kernels
        return cls(_upload(h.offsets, device), _upload(np.pad(h.tokens, (0, pad)), device),
                   _upload(np.pad(h.bias, (0, pad)), device),
                   _upload(np.pad(h.ban_after, (0, pad), constant_values=BAN_NONE), device), h.scratch_rows)

    @staticmethod
    def merge(num_rows: int, *, bias_rows: Sequence[int] = (), bias_tokens: Sequence[int] = (),
              bias_values: Sequence[float] = (), ban_rows: Sequence[int] = (), ban_tokens: Sequence[int] = (),
              ban_after: Sequence[int] = ()) -> SparseHost:
        """Merge (row, token) lists the way workers/logits_processing.py applies them: biases of one token
        add up; a token banned unconditionally is banned once; conditional bans keep one entry each.
        `ban_after`: -1 (always) or the last token that triggers the ban. Returns the CSR on the host.
        Raises ValueError on a row out of range or lists of unequal length."""
        if not (len(bias_rows) == len(bias_tokens) == len(bias_values) and len(ban_rows) == len(ban_tokens)
                == len(ban_after)):
            raise ValueError("each list of sparse entries must have one value per entry")
        total_bias: dict[tuple[int, int], float] = {}
        for r, t, b in zip(bias_rows, bias_tokens, bias_values):
            total_bias[(int(r), int(t))] = total_bias.get((int(r), int(t)), 0.0) + float(b)
        conditions: dict[tuple[int, int], set[int]] = {}
        for r, t, a in zip(ban_rows, ban_tokens, ban_after):
            conditions.setdefault((int(r), int(t)), set()).add(int(a))
        keys = sorted(set(total_bias) | set(conditions))
        rows_of: list[int] = []
        tokens: list[int] = []
        bias: list[float] = []
        after: list[int] = []
        for key in keys:
            when = conditions.get(key, set())
            labels = [BAN_ALWAYS] if BAN_ALWAYS in when else sorted(when) or [BAN_NONE]
            for label in labels:
                rows_of.append(key[0])
                tokens.append(key[1])
                bias.append(total_bias.get(key, 0.0))
                after.append(label)
        rows_arr = np.asarray(rows_of, dtype=np.int64)
        if len(rows_arr) and (rows_arr.min() < 0 or rows_arr.max() >= num_rows):
            raise ValueError(f"sparse entries name rows outside 0..{num_rows - 1}")
        offsets = np.zeros(num_rows + 1, dtype=np.int32)
        np.add.at(offsets, rows_arr + 1, 1)
        offsets = np.cumsum(offsets, dtype=np.int32)
        has_entries = offsets[1:] > offsets[:-1]
        scratch = np.where(has_entries, np.cumsum(has_entries) - 1, -1).astype(np.int32)
        return SparseHost(offsets, np.asarray(tokens, dtype=np.int32), np.asarray(bias, dtype=np.float32),
                          np.asarray(after, dtype=np.int64), scratch)


@dataclass
class SparseHost:
    """`SparseEntries` on the host (E entries over n rows): what a CUDA graph's static CSR is filled from."""

    offsets: np.ndarray  # [n + 1] int32
    tokens: np.ndarray  # [E] int32
    bias: np.ndarray  # [E] float32
    ban_after: np.ndarray  # [E] int64
    scratch_rows: np.ndarray  # [n] int32


class ProcessingInputsLike(Protocol):
    """The fields of workers/logits_processing.py's `ProcessingInputs` that `from_processing` reads."""

    rows: np.ndarray
    batch_rows: np.ndarray
    temperatures: np.ndarray
    sample_temperatures: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    penalty_rows: np.ndarray
    bias_rows: np.ndarray
    bias_tokens: np.ndarray
    bias_values: np.ndarray
    ban_rows: np.ndarray
    ban_tokens: np.ndarray
    ban_after: np.ndarray
    logprob_rows: np.ndarray
    logprob_counts: np.ndarray
    grammar_rows: np.ndarray


def from_processing(h: ProcessingInputsLike | None, temperatures: np.ndarray, vocab_size: int,
                    device: torch.device | str) -> tuple[ProcessedParams, SparseEntries]:
    """The parameters and sparse entries of a whole step on the device (`processing_host`, uploaded)."""
    floats, ints, sparse = processing_host(h, temperatures, vocab_size)
    return ProcessedParams(_upload(floats, device), _upload(ints, device), floats, ints), \
        SparseEntries.upload(sparse, device)


def processing_host(h: ProcessingInputsLike | None, temperatures: np.ndarray, vocab_size: int
                    ) -> tuple[np.ndarray, np.ndarray, SparseHost]:
    """The parameter tables (`ProcessedParams.pack`) and sparse entries (`SparseEntries.merge`) of a whole step,
    on the host, from its temperatures `[S]` float32 (0 = greedy) and the processed rows' `ProcessingInputs`
    (None: every row is plain). Rows not in `h.rows` are plain.

    The grammar bitmask row of processed row j is its position in `h.grammar_rows` (the order of
    `DeviceProcessing.bitmask`); the state row is `h.batch_rows` (penalties and the last sampled token)."""
    n = len(temperatures)
    t = np.asarray(temperatures, dtype=np.float32).copy()
    cols = {name: None for name in ("top_k", "top_p", "min_p", "repetition", "frequency", "presence",
                                    "state_rows", "grammar_rows", "num_logprobs")}
    if h is None:
        return *ProcessedParams.pack(t, vocab_size), SparseEntries.merge(n)
    rows = np.asarray(h.rows, dtype=np.int64)
    greedy = np.asarray(h.sample_temperatures) <= 0
    t[rows] = np.where(greedy, 0.0, h.temperatures)
    full = {"top_k": (0, h.top_k), "top_p": (1.0, h.top_p), "min_p": (0.0, h.min_p),
            "repetition": (1.0, h.repetition), "frequency": (0.0, h.frequency), "presence": (0.0, h.presence),
            "state_rows": (-1, h.batch_rows)}
    for name, (default, values) in full.items():
        a = np.full(n, default, dtype=np.float64)
        a[rows] = values
        cols[name] = a
    grammar = np.full(n, -1, dtype=np.int64)
    grammar[rows[np.asarray(h.grammar_rows, dtype=np.int64)]] = np.arange(len(h.grammar_rows))
    logprobs = np.full(n, -1, dtype=np.int64)
    logprobs[rows[np.asarray(h.logprob_rows, dtype=np.int64)]] = h.logprob_counts
    cols["grammar_rows"], cols["num_logprobs"] = grammar, logprobs
    ban_after = np.asarray(h.ban_after, dtype=np.int64)
    sparse = SparseEntries.merge(
        n, bias_rows=rows[np.asarray(h.bias_rows, dtype=np.int64)].tolist(),
        bias_tokens=np.asarray(h.bias_tokens).tolist(), bias_values=np.asarray(h.bias_values).tolist(),
        ban_rows=rows[np.asarray(h.ban_rows, dtype=np.int64)].tolist(), ban_tokens=np.asarray(h.ban_tokens).tolist(),
        ban_after=np.where(ban_after < 0, BAN_ALWAYS, ban_after).tolist())
    return *ProcessedParams.pack(t, vocab_size, scratch_rows=sparse.scratch_rows, **cols), sparse


class RequestTokens(Protocol):
    """What `PenaltyBits.reset_rows` reads of a request (workers/input_batch.py's ReqState has it)."""

    row: int
    tokens: np.ndarray
    num_tokens: int
    num_prompt_tokens: int


class PenaltyBits:
    """Per-request token state for the penalties, on the device, allocated on first use:

    - `seen` `[max_num_seqs, W]` int32: tokens of the prompt or the output (the repetition penalty);
    - `output` `[max_num_seqs, W]` int32: tokens generated at least once;
    - `counts` `[max_num_seqs, V]` int32: how often each was generated (frequency and presence penalties),
      read by the sampler only where `output` has the bit, so a row costs ~1/8 byte a token, not 4.

    W = ceil(V / 32); token t is bit t % 32 of word t // 32. A row is rebuilt from the host tokens when a
    penalized request takes it (`reset_rows`), and `record` adds each sampled token on the device.
    """

    def __init__(self, device: torch.device | str, max_num_seqs: int, vocab_size: int) -> None:
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.num_words = triton.cdiv(vocab_size, 32)
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seen, output, counts), allocated zeroed on first call."""
        if self._tensors is None:
            words = (self.max_num_seqs, self.num_words)
            self._tensors = (torch.zeros(words, dtype=torch.int32, device=self.device),
                             torch.zeros(words, dtype=torch.int32, device=self.device),
                             torch.zeros(self.max_num_seqs, self.vocab_size, dtype=torch.int32, device=self.device))
        return self._tensors

    def reset_rows(self, states: Sequence[RequestTokens]) -> None:
        """Rebuild the rows of `states` from their host tokens (`tokens[:num_tokens]`, the output from
        `num_prompt_tokens` on)."""
        if states:
            self.reset_rows_from_tokens([st.row for st in states], [st.tokens[: st.num_tokens] for st in states],
                                        [st.tokens[st.num_prompt_tokens: st.num_tokens] for st in states])

    def reset_rows_from_tokens(self, rows: Sequence[int], all_tokens: Sequence[np.ndarray],
                               output_tokens: Sequence[np.ndarray]) -> None:
        """Row rows[i] holds exactly `all_tokens[i]` as seen and `output_tokens[i]` as generated."""
        if not len(rows):
            return
        seen, output, counts = self.tensors()
        seen_host = _pack_bits(all_tokens, self.num_words)
        output_host = _pack_bits(output_tokens, self.num_words)
        counts_host = np.zeros((len(rows), self.vocab_size), dtype=np.int32)
        for i, toks in enumerate(output_tokens):
            np.add.at(counts_host[i], np.asarray(toks, dtype=np.int64), 1)
        index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=self.device)
        seen[index] = torch.from_numpy(seen_host).to(self.device)
        output[index] = torch.from_numpy(output_host).to(self.device)
        counts[index] = torch.from_numpy(counts_host).to(self.device)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row dst[i] takes row src[i]'s state (a forked sample starts with its parent's)."""
        if not len(src):
            return
        s = torch.as_tensor(np.asarray(src, dtype=np.int64), device=self.device)
        d = torch.as_tensor(np.asarray(dst, dtype=np.int64), device=self.device)
        for t in self.tensors():
            t[d] = t[s]

    def record(self, state_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record one sampled token per row on the device: seen, generated, counted once more.

        state_rows `[n]` int, any stride (-1: skip the row), tokens `[n]` int64. Passing the column
        `ProcessedParams.ints[:, I_STATE_ROW]` as is also records rows without penalties: harmless, since a
        penalized request's row is rebuilt by `reset_rows` when it takes the row, and only penalized rows are read.
        One launch, no host synchronisation (capturable); the updates are atomic, so two rows may share a state
        row."""
        n = state_rows.shape[0]
        if not n:
            return
        seen, output, counts = self.tensors()
        block = 128
        pdl = pdl_for(tokens)
        _record_kernel[(triton.cdiv(n, block),)](state_rows, state_rows.stride(0), tokens, seen, output, counts, n,
                                                 self.vocab_size, self.num_words, BLOCK=block, PDL=pdl, num_warps=1,
                                                 **launch_options(pdl))


@triton.jit
def _record_kernel(state_rows_ptr, stride_state_rows, tokens_ptr, seen_ptr, output_ptr, counts_ptr, n, vocab_size,
                   num_words, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)  # gpu_kernels/pdl.py: the sampled tokens are written and visible
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    srow = tl.load(state_rows_ptr + i * stride_state_rows, mask=valid, other=-1).to(tl.int64)
    token = tl.load(tokens_ptr + i, mask=valid, other=-1).to(tl.int64)
    valid = valid & (srow >= 0) & (token >= 0) & (token < vocab_size)
    word = srow * num_words + (token >> 5)
    bit = tl.full([BLOCK], 1, tl.int32) << (token & 31).to(tl.int32)
    tl.atomic_or(seen_ptr + word, bit, mask=valid)
    tl.atomic_or(output_ptr + word, bit, mask=valid)
    tl.atomic_add(counts_ptr + srow * vocab_size + token, tl.full([BLOCK], 1, tl.int32), mask=valid)


def _pack_bits(token_lists: Sequence[np.ndarray], num_words: int) -> np.ndarray:
    """`[len(token_lists), num_words]` int32 with bit t % 32 of word t // 32 set for every token t of each list."""
    words = np.zeros((len(token_lists), num_words), dtype=np.uint32)
    for i, toks in enumerate(token_lists):
        t = np.asarray(toks, dtype=np.int64)
        np.bitwise_or.at(words[i], t >> 5, (np.uint32(1) << (t & 31).astype(np.uint32)))
    return words.view(np.int32)


def _upload(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`a` on `device`; to a GPU through pinned memory, asynchronously (a copy from pageable memory may wait for
    the forward still running on the device)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
