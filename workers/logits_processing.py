"""Logits processing: the batched steps between the LM head and the sampler, for the rows that use them.

A row is "processed" when its request sets anything beyond temperature (SamplingOptions: a structured-output
grammar, filters, penalties, logit bias, bad words, min_tokens, logprobs). Rows that use only temperature never come
here: the fused sampler takes them straight from the LM head, as before, with no extra kernel.

The processed rows of a step are gathered into one float32 tensor `[R, vocab]` (all of the vocabulary:
under tensor parallelism the ranks all-gather these rows' slices, and every rank then processes and
samples them identically), and each step below runs once over all of them, with per-row parameter
tensors and sparse (row, token) lists. The order is vLLM's (its v0 sampler for the last three: top-k and
top-p, then min-p):

  0. structured outputs: tokens the row's grammar does not allow next get -inf (its packed bitmask, filled on
     the host by workers/structured_output.py, unpacked on the device), so nothing below can bring one back;
  1. logit bias: add each request's {token: bias};
  2. bans: the last token of a bad word whose other tokens end the output, and, while fewer than
     `min_tokens` tokens were generated, the request's stop tokens, get -inf;
  3. penalties: repetition (prompt and output tokens: a positive logit is divided by it, a negative one
     multiplied, as in vLLM and transformers), then frequency and presence (output tokens, OpenAI's
     definition: logit -= frequency * count + presence * (count > 0));
  4. temperature: logits / T (T = 1 for greedy rows);
  5. top-k, then top-p, then min-p, as one threshold per row; tokens below it get -inf:
     top-k keeps the logits >= the k-th largest (ties kept); top-p keeps a token when the probability
     of the tokens strictly more likely than it, among those top-k kept, is below p (ties are kept or
     dropped together; the most likely token always stays); min-p keeps logits >= max + log(min_p).

The sampler then draws from softmax of the result (Gumbel-max with the row's seed, exactly as for a
plain row at temperature 1) or takes its argmax for greedy rows. Logprobs are log_softmax of the result:
the distribution the token was drawn from.

Top-k/top-p without a sort of the whole vocabulary: rows with 0 < k <= TOPK_CANDIDATES take their
candidates from `torch.topk(k_max)`; only rows with top-p and no (or a very large) top-k sort the whole
row. Token counts for the penalties (`PenaltyState`) stay on the device and are updated there after each
sampling step, so a token still on its way to the host is counted (no new wire traffic, no host sync).
On CUDA the element-wise steps are compiled into one kernel each (`workers/layers/fused.py`), and a step
that covers every processed row works on the whole tensor without gathering it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.deterministic import row_reduce
from workers.host_buffers import to_device
from workers.layers.fused import fused
from workers.structured_output import apply_bitmask

if TYPE_CHECKING:
    from workers.request_state import ReqState
    from workers.structured_output import RequestGrammar

TOPK_CANDIDATES = 1024  # rows with a top-k up to this take their candidates from torch.topk, not a full sort
PROMPT_LOGPROBS_CHUNK = 256  # prompt positions whose full-vocabulary logits exist at once
NEG_INF = float("-inf")


# ============================================================================ host side
@dataclass
class ProcessingInputs:
    """Host arrays describing one step's processed rows. R rows; indices `rows` are into the step's
    sampling rows (its logits), `batch_rows` into the worker's persistent batch (penalty counts)."""

    rows: np.ndarray  # [R] int64
    batch_rows: np.ndarray  # [R] int64
    all_rows: bool  # every sampling row is processed
    temperatures: np.ndarray  # [R] float32, 1 for greedy rows (the divisor of step 4)
    sample_temperatures: np.ndarray  # [R] float32 for the sampler: 0 greedy, else 1 (T already applied)
    top_k: np.ndarray  # [R] int64, 0 = off
    top_p: np.ndarray  # [R] float32
    min_p: np.ndarray  # [R] float32
    repetition: np.ndarray  # [R] float32
    frequency: np.ndarray  # [R] float32
    presence: np.ndarray  # [R] float32
    penalty_rows: np.ndarray  # [Rp] int64 indices into R of rows with a penalty
    bias_rows: np.ndarray  # [b] int64 indices into R
    bias_tokens: np.ndarray  # [b] int64
    bias_values: np.ndarray  # [b] float32
    ban_rows: np.ndarray  # [m] int64 indices into R
    ban_tokens: np.ndarray  # [m] int64
    ban_after: np.ndarray  # [m] int64: ban only if the row's last sampled token (on the device) is this; -1 always
    logprob_rows: np.ndarray  # [L] int64 indices into R of rows that want logprobs
    logprob_counts: np.ndarray  # [L] int64 top-N of each
    uses_repetition: bool = False
    uses_frequency_presence: bool = False
    grammar_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [G] indices into R, constrained
    grammars: list[RequestGrammar] = field(default_factory=list)  # [G] their matchers (the bitmask is filled later)


def build_processing(states: list[ReqState], temperatures: np.ndarray, vocab_size: int,
                     batch_rows: np.ndarray | None = None) -> ProcessingInputs | None:
    """The processed rows among a step's sampling rows `states` (before their counters advance), or None.

    `temperatures`: `[S]` float32 of the step (0 = greedy); `batch_rows`: `[S]` the states' rows (read from
    them if None). Bad-word prefixes are matched against the output tokens on the host; the last one may
    still be on its way from the device, in which case the ban is made conditional on the device's last
    sampled token (`ban_after`).
    """
    if not states:  # a step of prefill chunks that do not end their prompts
        return None
    flags = [st.processed for st in states]
    if all(flags):
        picked: np.ndarray | list[int] = np.arange(len(states))
        picked_states = states
    else:
        picked = [i for i, f in enumerate(flags) if f]
        if not picked:
            return None
        picked_states = [states[i] for i in picked]
    if batch_rows is None:
        batch_rows = np.fromiter((st.row for st in states), np.int64, len(states))
    table = np.array([st.parameter_row for st in picked_states], dtype=np.float64)  # [R, 7]
    greedy = temperatures[picked] <= 0
    top_k = table[:, 0].astype(np.int64)
    top_k[(top_k <= 0) | (top_k >= vocab_size) | greedy] = 0
    repetition, frequency, presence = (table[:, c].astype(np.float32) for c in (3, 4, 5))
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    ban_after: list[int] = []
    for j, st in enumerate(picked_states):
        if not st.sparse:
            continue
        o = st.options
        if o.logit_bias:
            bias_rows.extend([j] * len(o.logit_bias))
            bias_tokens.extend(o.logit_bias)
            bias_values.extend(o.logit_bias.values())
        num_output = st.num_tokens - st.num_prompt_tokens
        if num_output < o.min_tokens and o.stop_token_ids:
            ban_rows.extend([j] * len(o.stop_token_ids))
            ban_tokens.extend(o.stop_token_ids)
            ban_after.extend([-1] * len(o.stop_token_ids))
        for word in o.bad_words:
            after = _bad_word_condition(st, word, num_output)
            if after is not None:
                ban_rows.append(j)
                ban_tokens.append(word[-1])
                ban_after.append(after)
    grammar_rows = [j for j, st in enumerate(picked_states) if st.grammar is not None]
    i64 = np.int64
    uses_repetition = repetition != 1.0
    uses_frequency_presence = (frequency != 0) | (presence != 0)
    logprob_rows = np.flatnonzero(table[:, 6] >= 0)
    return ProcessingInputs(
        rows=np.asarray(picked, dtype=i64),
        batch_rows=np.asarray(batch_rows, dtype=i64)[picked],
        all_rows=len(picked) == len(states),
        temperatures=np.where(greedy, 1.0, temperatures[picked]).astype(np.float32),
        sample_temperatures=np.where(greedy, 0.0, 1.0).astype(np.float32),
        top_k=top_k,
        top_p=np.where(greedy, 1.0, table[:, 1]).astype(np.float32),
        min_p=np.where(greedy, 0.0, table[:, 2]).astype(np.float32),
        repetition=repetition,
        frequency=frequency,
        presence=presence,
        penalty_rows=np.flatnonzero(uses_repetition | uses_frequency_presence),
        bias_rows=np.asarray(bias_rows, dtype=i64),
        bias_tokens=np.asarray(bias_tokens, dtype=i64),
        bias_values=np.asarray(bias_values, dtype=np.float32),
        ban_rows=np.asarray(ban_rows, dtype=i64),
        ban_tokens=np.asarray(ban_tokens, dtype=i64),
        ban_after=np.asarray(ban_after, dtype=i64),
        logprob_rows=logprob_rows,
        logprob_counts=table[logprob_rows, 6].astype(i64),
        uses_repetition=bool(uses_repetition.any()),
        uses_frequency_presence=bool(uses_frequency_presence.any()),
        grammar_rows=np.asarray(grammar_rows, dtype=i64),
        grammars=[picked_states[j].grammar for j in grammar_rows],
    )


def worst_case_inputs(n: int) -> ProcessingInputs:
    """`n` rows (batch rows 0..n-1) that use every step at its costliest: a grammar bitmask (the caller sets
    `DeviceProcessing.bitmask`), a whole-row sort for top-p, min-p, the three penalties and 20 logprobs (the
    start-up memory measurement runs it)."""
    from common.sampling_params import MAX_LOGPROBS

    i64, f32 = np.int64, np.float32
    rows = np.arange(n, dtype=i64)
    empty_i, empty_f = np.zeros(0, i64), np.zeros(0, f32)
    return ProcessingInputs(
        rows=rows, batch_rows=rows, all_rows=True, temperatures=np.full(n, 0.7, f32),
        sample_temperatures=np.ones(n, f32), top_k=np.zeros(n, i64), top_p=np.full(n, 0.9, f32),
        min_p=np.full(n, 0.05, f32), repetition=np.full(n, 1.1, f32), frequency=np.full(n, 0.5, f32),
        presence=np.full(n, 0.5, f32), penalty_rows=rows, bias_rows=empty_i, bias_tokens=empty_i,
        bias_values=empty_f, ban_rows=empty_i, ban_tokens=empty_i, ban_after=empty_i, logprob_rows=rows,
        logprob_counts=np.full(n, MAX_LOGPROBS, i64), uses_repetition=True, uses_frequency_presence=True,
        grammar_rows=rows)


def _bad_word_condition(st: ReqState, word: list[int], num_output: int) -> int | None:
    """Whether `word`'s last token is banned for `st`'s next token: None (no), -1 (yes), or a token id t
    (yes if the output's last token, not on the host yet, is t)."""
    prefix = len(word) - 1
    if prefix == 0:
        return -1
    if num_output < prefix:
        return None
    end = st.num_tokens
    on_host = st.num_tokens_cpu
    assert end - on_host <= 1, "at most one sampled token is ever on its way to the host"
    known = min(end, on_host)
    start = end - prefix
    if not np.array_equal(st.tokens[start:known], word[: known - start]):
        return None
    return -1 if known == end else word[prefix - 1]


@dataclass
class PromptLogprobsInputs:
    """Prompt positions of one step whose logprobs are reported. P positions in all."""

    seq_ids: list[int]  # [r] requests
    counts: list[int]  # [r] positions of each
    num_top: list[int]  # [r] top-N of each
    hidden_index: np.ndarray  # [P] int64 token index into the step's hidden states (the position before)
    target_ids: np.ndarray  # [P] int64 the prompt token whose logprob is reported


# ============================================================================ device side
class DeviceProcessing:
    """`ProcessingInputs` on the device: its index arrays in one int64 upload and its parameters in one
    float32 upload (two asynchronous copies a step), exposed as views by name (`d.i[...]`, `d.f[...]`)."""

    def __init__(self, host: ProcessingInputs, device: torch.device) -> None:
        self.host = h = host
        pr = h.penalty_rows
        is_fast = (h.top_k > 0) & (h.top_k <= TOPK_CANDIDATES)
        fast = np.flatnonzero(is_fast)
        full = np.flatnonzero(((h.top_p < 1.0) | (h.top_k > 0)) & ~is_fast)
        self.fast_groups = fast, full  # host copies, for the group sizes and top-k widths
        ints = {"rows": h.rows, "batch_rows": h.batch_rows, "penalty_rows": pr, "penalty_batch_rows": h.batch_rows[pr],
                "bias_rows": h.bias_rows, "bias_tokens": h.bias_tokens, "ban_rows": h.ban_rows,
                "ban_tokens": h.ban_tokens, "ban_after": h.ban_after, "ban_batch_rows": h.batch_rows[h.ban_rows],
                "fast": fast, "fast_k": h.top_k[fast], "full": full, "full_k": h.top_k[full],
                "logprob_rows": h.logprob_rows, "grammar_rows": h.grammar_rows}
        floats = {"temperatures": h.temperatures, "sample_temperatures": h.sample_temperatures, "min_p": h.min_p,
                  "repetition": h.repetition[pr], "frequency": h.frequency[pr], "presence": h.presence[pr],
                  "bias_values": h.bias_values, "fast_p": h.top_p[fast], "full_p": h.top_p[full]}
        self.i = _upload_packed(ints, np.int64, device)
        self.f = _upload_packed(floats, np.float32, device)
        # [G, ceil(vocab / 32)] int32 on the device: the grammar rows' masks, set once their matchers are up to
        # date (after the forward is launched: see workers/structured_output.py)
        self.bitmask: torch.Tensor | None = None


def _upload_packed(arrays: dict[str, np.ndarray], dtype: type, device: torch.device) -> dict[str, torch.Tensor]:
    flat = np.concatenate(list(arrays.values()), dtype=dtype)
    dev = to_device(flat, device)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, a in arrays.items():
        out[name] = dev[offset: offset + len(a)]
        offset += len(a)
    return out


class PenaltyState:
    """Per-row token state on the device, for the requests with penalties: `seen[row, token]` (bool: in the
    prompt or the output; the repetition penalty) and `output_counts[row, token]` (int32: times generated;
    the frequency and presence penalties). Allocated on first use, `[max_num_seqs, vocab]` each. A row is
    rebuilt from the host tokens whenever a penalized request takes it (first admission, or resumption
    after preemption), and then counts each sampled token."""

    def __init__(self, device: torch.device, max_num_seqs: int, vocab_size: int) -> None:
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None

    def _ensure(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seen is None:
            shape = (self.max_num_seqs, self.vocab_size)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        assert self.output_counts is not None
        return self.seen, self.output_counts

    def reset_rows(self, states: list[ReqState]) -> None:
        """Rebuild the rows of `states` (which hold their rows and all their tokens on the host)."""
        if not states:
            return
        seen, counts = self._ensure()
        rows = np.array([st.row for st in states], dtype=np.int64)
        all_tokens = [st.tokens[: st.num_tokens] for st in states]
        output_tokens = [st.tokens[st.num_prompt_tokens: st.num_tokens] for st in states]
        dev = self.device
        rows_dev = to_device(rows, dev)
        counts[rows_dev] = 0
        seen[rows_dev] = False
        s_rows = np.repeat(rows, [len(t) for t in all_tokens])
        seen[to_device(s_rows, dev), to_device(np.concatenate(all_tokens).astype(np.int64), dev)] = True
        o_rows = np.repeat(rows, [len(t) for t in output_tokens])
        if len(o_rows):
            o_tokens = to_device(np.concatenate(output_tokens).astype(np.int64), dev)
            counts.index_put_((to_device(o_rows, dev), o_tokens), torch.ones(len(o_rows), dtype=torch.int32,
                                                                             device=dev), accumulate=True)

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Row `dst[i]` takes row `src[i]`'s state (a forked sample starts with its parent's)."""
        if not src:
            return
        seen, counts = self._ensure()
        s, d = to_device(np.asarray(src, dtype=np.int64), self.device), to_device(np.asarray(dst, dtype=np.int64),
                                                                                  self.device)
        counts[d] = counts[s]
        seen[d] = seen[s]

    def add_sampled(self, batch_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record one sampled token per row, on the device: seen, and counted once more."""
        seen, counts = self._ensure()
        seen[batch_rows, tokens] = True
        counts.index_put_((batch_rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


class LogitsProcessor:
    """Runs the steps of the module docstring over a step's processed rows; holds the penalty counts."""

    def __init__(self, device: torch.device, max_num_seqs: int, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.penalties = PenaltyState(device, max_num_seqs, vocab_size)

    # ------------------------------------------------------------------ per step
    def upload(self, h: ProcessingInputs) -> DeviceProcessing:
        """Copy a step's processing inputs to the device (asynchronously)."""
        return DeviceProcessing(h, self.device)

    def apply(self, x: torch.Tensor, d: DeviceProcessing, last_sampled: torch.Tensor) -> torch.Tensor:
        """Run every step, in order, over `x` `[R, vocab]` float32 (modified in place; returned).

        `last_sampled`: `[max_num_seqs]` int64 on the device, each batch row's latest sampled token (for
        bad words whose prefix ends with a token still on its way to the host)."""
        for step in STEPS:
            x = step(self, x, d, last_sampled)
        return x

    def record_sampled(self, d: DeviceProcessing, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled for the penalized rows. `tokens`: `[S]` int64 of the whole step."""
        if len(d.host.penalty_rows):
            self.penalties.add_sampled(d.i["penalty_batch_rows"], tokens[d.i["rows"][d.i["penalty_rows"]]])

    def logprobs(self, x: torch.Tensor, d: DeviceProcessing, tokens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Logprobs of the rows that asked, from the processed logits `x` `[R, vocab]` and the step's sampled
        `tokens` `[S]`: (token logprob `[L]` f32, rank `[L]` int64, top logprobs `[L, N]` f32, top ids
        `[L, N]` int64), N the largest count asked; None if no row asked."""
        h = d.host
        if not len(h.logprob_rows):
            return None
        idx = d.i["logprob_rows"]
        rows = x if len(h.logprob_rows) == len(h.rows) else x[idx]  # logprob_rows is sorted: all of them is 0..R-1
        return token_logprobs(rows, tokens[d.i["rows"][idx]], int(h.logprob_counts.max()))


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of `logits` `[L, V]` at `chosen` `[L]`, the rank of `chosen` (1 + the number of tokens
    strictly more likely) and the `num_top` largest logprobs with their token ids (most likely first).
    From one logsumexp per row (`row_reduce`: batch-invariant in deterministic mode): the `[L, V]` log_softmax is
    never materialized."""
    x = logits.float()
    lse = row_reduce(x, lambda t: torch.logsumexp(t, dim=-1))
    chosen_x = x.gather(1, chosen.view(-1, 1))
    lp = chosen_x.squeeze(1) - lse
    rank = (x > chosen_x).sum(dim=-1) + 1
    if num_top > 0:
        top_x, top_ids = x.topk(min(num_top, x.shape[1]), dim=-1)
        top_lp = top_x - lse.unsqueeze(1)
    else:
        top_lp = x.new_zeros(x.shape[0], 0)
        top_ids = torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device)
    return lp, rank, top_lp, top_ids


# ============================================================================ the steps
def _grammar_bitmask(proc: LogitsProcessor, x: torch.Tensor, d: DeviceProcessing, last: torch.Tensor) -> torch.Tensor:
    if not len(d.host.grammar_rows):
        return x
    assert d.bitmask is not None, "the grammar rows' bitmask must be uploaded before the logits are processed"
    if len(d.host.grammar_rows) == x.shape[0]:  # every processed row is constrained: no gather/scatter of x
        return _masked(x, d.bitmask)
    rows = d.i["grammar_rows"]
    x[rows] = _masked(x[rows], d.bitmask)
    return x


_masked = fused(apply_bitmask)


def _logit_bias(proc: LogitsProcessor, x: torch.Tensor, d: DeviceProcessing, last: torch.Tensor) -> torch.Tensor:
    if len(d.host.bias_rows):
        x.index_put_((d.i["bias_rows"], d.i["bias_tokens"]), d.f["bias_values"], accumulate=True)
    return x


def _bans(proc: LogitsProcessor, x: torch.Tensor, d: DeviceProcessing, last: torch.Tensor) -> torch.Tensor:
    if len(d.host.ban_rows):
        rows, tokens, after = d.i["ban_rows"], d.i["ban_tokens"], d.i["ban_after"]
        active = (after < 0) | (last[d.i["ban_batch_rows"]] == after)
        current = x[rows, tokens]
        x[rows, tokens] = torch.where(active, torch.full_like(current, NEG_INF), current)
    return x


def _penalties(proc: LogitsProcessor, x: torch.Tensor, d: DeviceProcessing, last: torch.Tensor) -> torch.Tensor:
    h = d.host
    if not (h.uses_repetition or h.uses_frequency_presence):
        return x
    seen_all, counts_all = proc.penalties._ensure()
    whole = len(h.penalty_rows) == len(h.rows)  # every processed row has a penalty: no gather/scatter of x
    rows, batch_rows = d.i["penalty_rows"], d.i["penalty_batch_rows"]
    sub = x if whole else x[rows]
    if h.uses_repetition:
        sub = _repetition(sub, seen_all[batch_rows], d.f["repetition"].unsqueeze(1))
    if h.uses_frequency_presence:
        sub = _frequency_presence(sub, counts_all[batch_rows], d.f["frequency"].unsqueeze(1),
                                  d.f["presence"].unsqueeze(1))
    if whole:
        return sub
    x[rows] = sub
    return x


@fused
def _repetition(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Seen tokens' logits: positive ones divided by the penalty, negative ones multiplied (`penalty` [R, 1])."""
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


@fused
def _frequency_presence(x: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                        presence: torch.Tensor) -> torch.Tensor:
    c = counts.to(torch.float32)
    return x - frequency * c - presence * (c > 0).to(torch.float32)


@fused
def _mask_below(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """`x` with every entry below its row's `threshold` ([R, 1]) at -inf."""
    return torch.where(x < threshold, torch.full_like(x, NEG_INF), x)


def _temperature(proc: LogitsProcessor, x: torch.Tensor, d: DeviceProcessing, last: torch.Tensor) -> torch.Tensor:
    if bool((d.host.temperatures != 1.0).any()):
        x.div_(d.f["temperatures"].unsqueeze(1))
    return x


def _top_k_top_p_min_p(proc: LogitsProcessor, x: torch.Tensor, d: DeviceProcessing,
                       last: torch.Tensor) -> torch.Tensor:
    h = d.host
    fast, full = d.fast_groups
    if not (len(fast) or len(full) or (h.min_p > 0).any()):
        return x
    threshold = torch.full((x.shape[0],), NEG_INF, dtype=torch.float32, device=x.device)
    for name, group in (("fast", fast), ("full", full)):
        if not len(group):
            continue
        idx = d.i[name]
        every_row = len(group) == x.shape[0]  # groups are sorted: all of them is 0..R-1, no gather needed
        rows = x if every_row else x[idx]
        if name == "fast":  # every row has 0 < k <= TOPK_CANDIDATES: the candidates are its top k_max
            candidates = rows.topk(int(h.top_k[group].max()), dim=-1).values
        else:  # top-p without a small top-k: sort the whole row
            candidates = rows.sort(dim=-1, descending=True).values
        kept = top_k_top_p_threshold(rows, candidates, d.i[f"{name}_k"], d.f[f"{name}_p"],
                                     any_p=bool((h.top_p[group] < 1.0).any()), exact_candidates=name == "full")
        if every_row:
            threshold = kept
        else:
            threshold[idx] = kept
    if (h.min_p > 0).any():
        log_min_p = torch.log(d.f["min_p"].double())  # -inf where min_p is 0
        threshold = torch.maximum(threshold, (x.amax(dim=-1).double() + log_min_p).to(torch.float32))
    return _mask_below(x, threshold.unsqueeze(1))


def top_k_top_p_threshold(rows: torch.Tensor, candidates: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                          any_p: bool, exact_candidates: bool) -> torch.Tensor:
    """Per row, the smallest logit that top-k then top-p keep (every logit >= it is kept).

    rows `[G, V]`; candidates `[G, K]` the row's K largest logits, descending (K = V when
    `exact_candidates`, a full sort); k `[G]` int64 (0 = off; <= K when not exact); p `[G]` float32.
    Probabilities in float64. Tokens tied with the k-th logit are all kept, also those beyond the K
    candidates (their mass is counted from `rows`).

    Top-p keeps a candidate when the mass of the kept candidates before it is below p; with ties the
    mass strictly above a tie group is the exclusive sum at its first member, so whole groups are kept
    or dropped. The returned threshold is a value: the last candidate whose exclusive sum is below p
    belongs to the last kept group (its first member's sum is no larger), and the first member of any
    later group has a sum at least that of the first candidate past it, which is not below p.
    """
    width = candidates.shape[1]
    k_eff = torch.where(k > 0, k.clamp(max=width), torch.full_like(k, width))
    t_k = candidates.gather(1, (k_eff - 1).unsqueeze(1))  # [G, 1] the k-th largest logit
    if not any_p:
        return t_k.squeeze(1)
    top = candidates[:, :1].double()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    kept_k = candidates >= t_k  # a prefix of the candidates
    w = torch.exp(candidates.double() - top).masked_fill_(~kept_k, 0.0)  # unnormalized probabilities
    total = row_reduce(w, lambda t: t.sum(dim=-1))
    if not exact_candidates:  # ties with the k-th logit outside the candidates carry mass too
        extra = (rows >= t_k).sum(dim=-1) - kept_k.sum(dim=-1)
        total = total + extra.double() * torch.exp(t_k.squeeze(1).double() - top.squeeze(1))
    before = torch.cumsum(w, dim=-1).sub_(w)  # mass of the candidates before each one
    keep = kept_k & (before < (p.double() * total).unsqueeze(1))  # a prefix too: `before` never decreases
    last = (keep.sum(dim=-1) - 1).clamp(min=0)
    return candidates.gather(1, last.unsqueeze(1)).squeeze(1)


# The pipeline, in order (the module docstring).
STEPS = (_grammar_bitmask, _logit_bias, _bans, _penalties, _temperature, _top_k_top_p_min_p)


def gather_vocabulary(logits: torch.Tensor, vocab_size: int, rows_per_rank: int) -> torch.Tensor:
    """Whole-vocabulary rows from every rank's slice (tensor parallelism): `[n, slice]` -> `[n, vocab]`
    float32 on every rank. A collective: every rank calls it for the same rows."""
    from workers.parallel import all_gather, tp_size

    x = logits.float()
    if tp_size() == 1:
        return x.clone() if x.data_ptr() == logits.data_ptr() else x  # the steps write into it
    if x.shape[1] < rows_per_rank:  # the last rank's slice is shorter: pad it to the common width
        x = torch.nn.functional.pad(x, (0, rows_per_rank - x.shape[1]), value=NEG_INF)
    gathered = all_gather(x.contiguous())  # [ranks, n, rows_per_rank]
    return gathered.permute(1, 0, 2).reshape(x.shape[0], -1)[:, :vocab_size].contiguous()


