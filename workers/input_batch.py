"""The worker's persistent per-request state, and step inputs built from it without per-token loops.

Each live request owns a row of fixed-size host arrays (its token ids and its block table)
from its first plan until it is finished or preempted. Rows are handed out lowest-free-first in
plan order, so every tensor-parallel rank assigns the same rows. A step plan (deltas only) is
applied to this state with `apply`; `prepare` then computes positions, slot mapping, block
tables and sampling indices with numpy over the scheduled rows.

Token ids known to a worker: the prompt plus every token it sampled. A token sampled in the
previous step may still be on its way to the host (`num_tokens_cpu < num_tokens`); such a token
is fed to the next step straight from the device (`StepInputs.gpu_token_index`).

A forked sample (n > 1, `ForkedRequest`) takes a row of its own in the step that computes the end of
its parent's prompt, with a copy of the parent's prompt tokens; it samples after the step's rows,
from the parent's logits (`StepInputs.logits_indices` names the parent's last token for it).

A constrained request (structured outputs) holds its grammar's matcher (`ReqState.grammar`) from its first
plan on; it is made by the `new_grammar` factory the batch is given, and kept through preemption, since the
request's tokens are.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.protocol import StepPlan
from workers.logits_processing import ProcessingInputs, PromptLogprobsInputs, build_processing
from workers.request_state import ReqState

if TYPE_CHECKING:
    from workers.structured_output import RequestGrammar


@dataclass
class StepInputs:
    """Host-side inputs of one step. B sequences, T tokens, S sampling rows."""

    input_ids: np.ndarray  # [T] int64; 0 where the id comes from the device (gpu_token_index)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    rows: np.ndarray  # [B] int64, each sequence's row
    num_blocks_used: int  # widest block table in the step, in blocks
    gpu_token_index: np.ndarray  # [g] int64 token indices whose id is the row's last sampled token
    gpu_token_rows: np.ndarray  # [g] int64 the rows holding those tokens
    logits_indices: np.ndarray  # [S] int64, last token of each sampling sequence
    sampling_rows: np.ndarray  # [S] int64
    sampling_states: list[ReqState]
    temperatures: np.ndarray  # [S] float32
    seeded_rows: list[tuple[int, int, int]]  # (index among sampling rows, seed, position of the new token)
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    processing: ProcessingInputs | None = None  # the sampling rows that go through logits processing
    prompt_logprobs: PromptLogprobsInputs | None = None
    forks: list[tuple[ReqState, ReqState]] = field(default_factory=list)  # (fork, parent), sampling after the rows


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int, block_size: int,
                 vocab_size: int = 0, new_grammar: Callable[[int, int, int], RequestGrammar] | None = None) -> None:
        self.block_size = block_size
        # (grammar id, reasoning end and start token ids) -> a matcher at its start (structured outputs)
        self.new_grammar = new_grammar
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size  # of the model: top_k >= it is off
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int32)
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.reqs: dict[int, ReqState] = {}
        self._free_rows = list(range(max_num_seqs))  # a heap: lowest row first
        self.forks: list[tuple[ReqState, ReqState]] = []  # of the plan just applied: (fork, parent)
        self.admitted_penalized: list[ReqState] = []  # of the plan just applied
        self.num_processed = 0  # live requests whose logits are processed: none, and a step skips that path
        # The last step's processed rows with their key (`_processing`): a decode step of the same requests in the
        # same rows, none with sparse entries, has the same ones.
        self._last_processing: tuple[tuple[tuple[int, ...], bytes], ProcessingInputs] | None = None

    # ------------------------------------------------------------------ plan deltas
    def _take_row(self, st: ReqState) -> None:
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests are live on this worker")
        st.row = heapq.heappop(self._free_rows)

    def _release_row(self, st: ReqState) -> None:
        if st.row is not None:
            heapq.heappush(self._free_rows, st.row)
            st.row = None
        st.num_blocks = 0

    def _set_blocks(self, st: ReqState, block_ids: np.ndarray) -> None:
        assert st.row is not None
        self.block_table[st.row, : len(block_ids)] = block_ids
        st.num_blocks = len(block_ids)

    def apply(self, plan: StepPlan) -> list[tuple[ReqState, int]]:
        """Apply a plan's deltas; return the step's (request, scheduled tokens) rows in row order. The
        plan's forked requests are left in `forks` for `prepare`, and the penalized requests that took a
        row in `admitted_penalized` (their device token counts are rebuilt before `prepare`).

        Raises `KeyError` if the plan names a request this worker does not hold (a protocol bug).
        """
        self.forks = []
        self.admitted_penalized = []
        if plan.new_requests or plan.forked_requests:  # new request states: keys by seq id start afresh
            self._last_processing = None
        for seq_id in plan.finished_seq_ids.tolist():
            st = self.reqs.pop(seq_id, None)
            if st is not None:
                st.active = False
                self._release_row(st)
                self.num_processed -= st.processed
        for seq_id in plan.preempted_seq_ids.tolist():
            st = self.reqs[seq_id]
            st.tokens = st.tokens[: st.num_tokens].copy()  # keep its tokens (a late one lands here too)
            self._release_row(st)
            st.num_computed = 0
        scheduled: list[tuple[ReqState, int]] = []
        for req in plan.new_requests:
            st = ReqState(req.seq_id, req.temperature, req.seed, req.options)
            self._attach_grammar(st)
            self._take_row(st)
            n = len(req.prompt_token_ids)
            st.tokens = self.token_ids[st.row]
            st.tokens[:n] = req.prompt_token_ids
            st.num_tokens = st.num_tokens_cpu = st.num_prompt_tokens = n
            st.num_computed = req.num_computed_tokens
            self._set_blocks(st, req.block_ids)
            self.reqs[req.seq_id] = st
            scheduled.append((st, req.num_scheduled_tokens))
            self.num_processed += st.processed
            if st.penalized:
                self.admitted_penalized.append(st)
        for req in plan.resumed_requests:
            st = self.reqs[req.seq_id]
            assert st.num_tokens == st.num_tokens_cpu, "resumed before its last token reached the host"
            self._take_row(st)
            row_tokens = self.token_ids[st.row]
            row_tokens[: st.num_tokens] = st.tokens[: st.num_tokens]
            st.tokens = row_tokens
            st.num_computed = req.num_computed_tokens
            self._set_blocks(st, req.block_ids)
            scheduled.append((st, req.num_scheduled_tokens))
            if st.penalized:
                self.admitted_penalized.append(st)
        for nb in plan.new_blocks:
            st = self.reqs[nb.seq_id]
            k = len(nb.block_ids)
            self.block_table[st.row, st.num_blocks: st.num_blocks + k] = nb.block_ids
            st.num_blocks += k
        reqs = self.reqs
        for seq_id, n in zip(plan.prefill_seq_ids.tolist(), plan.prefill_num_tokens.tolist()):
            scheduled.append((reqs[seq_id], n))
        for seq_id in plan.decode_seq_ids.tolist():
            scheduled.append((reqs[seq_id], 1))
        for fork in plan.forked_requests:
            parent = reqs[fork.parent_seq_id]
            st = ReqState(fork.seq_id, parent.temperature, fork.seed, parent.options)
            self._attach_grammar(st)  # at its start: the parent has no output token yet either
            self._take_row(st)
            n = st.num_prompt_tokens = st.prompt_logprobs_next = parent.num_prompt_tokens  # its prompt: reported
            st.tokens = self.token_ids[st.row]
            st.tokens[:n] = parent.tokens[:n]
            st.num_tokens = st.num_tokens_cpu = n
            self._set_blocks(st, fork.block_ids)
            reqs[fork.seq_id] = st
            self.num_processed += st.processed
            self.forks.append((st, parent))
        return scheduled

    def _attach_grammar(self, st: ReqState) -> None:
        gid = st.options.grammar_id if st.options is not None else -1
        if gid >= 0:
            if self.new_grammar is None:
                raise RuntimeError(f"request {st.seq_id} has a grammar but this batch has no structured outputs")
            assert st.options is not None
            st.grammar = self.new_grammar(gid, st.options.reasoning_end_token_id, st.options.reasoning_start_token_id)

    # ------------------------------------------------------------------ step inputs
    def _processing(self, states: list[ReqState], temperatures: np.ndarray, rows: np.ndarray
                    ) -> ProcessingInputs | None:
        """`build_processing` of a step's sampling rows, or the last step's result when the step samples the same
        requests in the same rows and none of them has sparse entries (bias, bans: they follow the output). A
        steady decode batch thus builds its processed rows once, not every step (40 us at one row, 130 us at 256 on
        the CI machine, on the way from a result to the launch that waits for it). Grammar rows are reused too: a
        request keeps its matcher from its first plan to its end (new requests and forks start afresh), and the
        step's bitmask is filled from the matchers later, every step."""
        key = (tuple([st.seq_id for st in states]), rows.tobytes())
        last = self._last_processing
        if last is not None and last[0] == key:
            return last[1]
        h = build_processing(states, temperatures, self.vocab_size, rows)
        reusable = h is not None and not any(st.sparse for st in states)
        self._last_processing = (key, h) if reusable else None
        return h

    def prepare(self, scheduled: list[tuple[ReqState, int]]) -> StepInputs:
        """Build the step's host inputs and advance the requests' counters as if it ran."""
        b = len(scheduled)
        rows = np.fromiter((st.row for st, _ in scheduled), np.int64, b)
        num_new = np.fromiter((n for _, n in scheduled), np.int64, b)
        start = np.fromiter((st.num_computed for st, _ in scheduled), np.int64, b)
        on_host = np.fromiter((st.num_tokens_cpu for st, _ in scheduled), np.int64, b)
        known = np.fromiter((st.num_tokens for st, _ in scheduled), np.int64, b)
        query_start_loc = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        seq_index = np.repeat(np.arange(b), num_new)  # [T] which sequence each token belongs to
        positions = np.arange(int(query_start_loc[-1]), dtype=np.int64) - query_start_loc[seq_index] + start[seq_index]
        token_rows = rows[seq_index]
        from_device = positions >= on_host[seq_index]
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        input_ids[from_device] = 0
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (start + num_new).astype(np.int32)
        samples = seq_lens == known
        sampling_states = [st for (st, _), s in zip(scheduled, samples.tolist()) if s]
        logits_indices = (query_start_loc[1:][samples] - 1).astype(np.int64)
        sampling_rows = rows[samples]
        forks = self.forks
        if forks:  # each fork samples from its parent's logits, after the step's own sampling rows
            parent_index = {id(st): i for i, st in enumerate(sampling_states)}
            assert all(id(parent) in parent_index for _, parent in forks), "a fork's parent must sample this step"
            logits_indices = np.concatenate([logits_indices, [logits_indices[parent_index[id(p)]] for _, p in forks]
                                             ]).astype(np.int64)
            sampling_rows = np.concatenate([sampling_rows, [f.row for f, _ in forks]]).astype(np.int64)
            sampling_states = sampling_states + [f for f, _ in forks]
        seeded = [(i, st.seed, st.num_tokens) for i, st in enumerate(sampling_states) if st.seed is not None]
        temperatures = np.fromiter((st.temperature for st in sampling_states), np.float32, len(sampling_states))
        processing = self._processing(sampling_states, temperatures, sampling_rows) if self.num_processed else None
        prompt_logprobs = self._prompt_logprob_positions(scheduled, start, query_start_loc)
        for st, n in scheduled:
            st.num_computed += n
        for fork, parent in forks:
            fork.num_computed = parent.num_computed
        for st in sampling_states:
            st.num_tokens += 1
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            rows=rows,
            num_blocks_used=int(-(-int(seq_lens.max()) // bs)) if b else 0,
            gpu_token_index=np.flatnonzero(from_device),
            gpu_token_rows=token_rows[from_device],
            logits_indices=logits_indices,
            sampling_rows=sampling_rows,
            sampling_states=sampling_states,
            temperatures=temperatures,
            seeded_rows=seeded,
            max_query_len=int(num_new.max()) if b else 0,
            max_seq_len=int(seq_lens.max()) if b else 0,
            is_decode=bool(b) and bool((num_new == 1).all()),
            processing=processing,
            prompt_logprobs=prompt_logprobs,
            forks=forks,
        )

    @staticmethod
    def _prompt_logprob_positions(scheduled: list[tuple[ReqState, int]], start: np.ndarray,
                                  query_start_loc: np.ndarray) -> PromptLogprobsInputs | None:
        """The prompt tokens whose logprobs this step's forward computes and nobody reported yet: token t
        comes from the logits at position t - 1, so a chunk of positions [s, s + n) reports prompt tokens
        max(next, s + 1) .. min(s + n, prompt length - 1)."""
        out: PromptLogprobsInputs | None = None
        for b, (st, n) in enumerate(scheduled):
            o = st.options
            if o is None or o.prompt_logprobs < 0:
                continue
            s = int(start[b])
            first = max(st.prompt_logprobs_next, s + 1)
            last = min(s + n, st.num_prompt_tokens - 1)
            if last < first:
                continue
            if out is None:
                out = PromptLogprobsInputs([], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64))
            targets = np.arange(first, last + 1)
            out.seq_ids.append(st.seq_id)
            out.counts.append(len(targets))
            out.num_top.append(o.prompt_logprobs)
            out.hidden_index = np.concatenate([out.hidden_index, int(query_start_loc[b]) + targets - 1 - s])
            out.target_ids = np.concatenate([out.target_ids, st.tokens[targets].astype(np.int64)])
            st.prompt_logprobs_next = last + 1
        return out

    @staticmethod
    def append_sampled(states: list[ReqState], tokens: np.ndarray) -> list[tuple[ReqState, int]]:
        """Record tokens that reached the host, in the order the step sampled them. Returns the (request,
        token) pairs of the live constrained requests, whose matchers must advance by those tokens."""
        constrained = []
        for st, token in zip(states, tokens.tolist()):
            if st.active:
                st.tokens[st.num_tokens_cpu] = token
                st.num_tokens_cpu += 1
                if st.grammar is not None:
                    constrained.append((st, token))
        return constrained
