"""Scheduling policy: which requests run in the next step, and for how many tokens.

Continuing batching with a token budget, in the style of vLLM's v1 scheduler:
- Every step has `max_num_batched_tokens` tokens to hand out. Running requests come first,
  oldest first: a decode takes 1 token, an unfinished prompt takes a chunk (chunked prefill,
  for any request). Then waiting requests are admitted in arrival order while the budget,
  `max_num_seqs` and free blocks allow. Prefill chunks and decodes share a step.
- When a running request needs a block and none is free, the newest running request is
  preempted (its blocks freed, recomputed later). The oldest request is never preempted for
  a newer one, so it always progresses; a step that preempts admits nobody (no thrashing).
- Steps are pipelined: step N+1 is planned while the workers compute step N. A request's
  token sampled in step N is "pending" until its result arrives; the workers feed it as the
  input of step N+1 themselves. At most `max_steps_in_flight` steps are outstanding.
- Limits: a prompt must be shorter than `max_model_len` and fit in the whole KV cache; output
  stops at `max_tokens`, at `max_model_len` total tokens, or when the whole cache cannot hold
  the request's next token (all three finish with reason "length"); a stop token ends it (reason
  "stop") once `min_tokens` tokens were generated.
- Samples (n > 1): the prompt is computed once, by sample 0. In the step that computes its last
  prompt token, samples 1..n-1 are forked from it: each takes the full prompt blocks by reference
  count and a block of its own for a copy of the last, partial one (copy-on-write; the workers copy
  its KV after the forward), and samples its first token from the same logits with its own seed.
  Samples that do not fit then (no free block, or `max_num_seqs`) wait as new requests, whose full
  prompt blocks are prefix-cache hits. From the fork on, every sample is a sequence of its own.
- Structured outputs: a request with a grammar joins the waiting queue only once every worker rank has
  compiled it (`grammar_cache.py`); until then it holds nothing and delays nobody. A grammar that cannot be
  compiled fails its requests with the compiler's reason, and so does a token the grammar refused
  (`StepResult.failed`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from common.limits import prompt_limit_error
from common.protocol import (
    CompileGrammars,
    EngineRequest,
    FinishedSeq,
    ForkedRequest,
    GrammarCompiled,
    Logprobs,
    NewBlocks,
    NewRequest,
    ResumedRequest,
    SamplingOptions,
    SchedulerStats,
    StepOutputs,
    StepPlan,
    StepResult,
    i32,
)
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.grammar_cache import GrammarCache
from scheduler_proc.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int
    block_size: int  # tokens per block
    max_model_len: int  # tokens, prompt + output
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    max_steps_in_flight: int = 2
    vocab_size: int = 0  # 0: do not check token ids (the frontend already did)
    num_ranks: int = 1  # worker ranks: each compiles every grammar and says so


@dataclass
class InFlightStep:
    step_id: int
    sampling_seqs: list[Sequence]  # rows that sample, in row order
    num_scheduled_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.seqs: dict[int, Sequence] = {}
        self.in_flight: deque[InFlightStep] = deque()
        self.next_step_id = 0
        self.finished_for_workers: list[int] = []  # ended since the last plan; workers still hold them
        self.unreported: list[FinishedSeq] = []  # ended while planning (cache too small); see take_finished
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admission, since start
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self.grammars = GrammarCache(config.num_ranks)

    # ------------------------------------------------------------------ intake
    def add_request(self, req: EngineRequest) -> list[FinishedSeq]:
        """Queue a request; if it can never run, queue nothing and return the error of each of its
        samples' seq ids (empty when queued)."""
        error = self.check_request(req)
        if error is not None:
            return [FinishedSeq(req.seq_id + i, "error", 0, error) for i in range(max(1, req.n))]
        seq = Sequence(req)
        if req.grammar is not None:
            entry = self.grammars.acquire(req.grammar)
            seq.options = dataclasses.replace(seq.options or SamplingOptions(), grammar_id=entry.grammar_id)
            if entry.error is not None:  # compiled before, and failed: fail at once
                self.grammars.release(entry.grammar_id)
                return [FinishedSeq(req.seq_id + i, "error", 0, entry.error) for i in range(max(1, req.n))]
            if not entry.ready:
                seq.status = SeqStatus.WAITING_FOR_GRAMMAR
                entry.waiting.append(seq)
                self.seqs[seq.seq_id] = seq
                return []
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        return []

    def take_grammar_work(self) -> CompileGrammars | None:
        """The grammars the workers must compile (and may forget) since the last call: send it to every rank
        before the next plan."""
        return self.grammars.take_work()

    def grammar_compiled(self, msg: GrammarCompiled) -> list[FinishedSeq]:
        """Apply one rank's answer: once every rank compiled the grammar, its requests join the waiting queue
        (in arrival order); if it failed, they end with its error, which is returned."""
        entry = self.grammars.compiled(msg.rank, msg.grammar_id, msg.error)
        if entry is None:
            return []
        waiting, entry.waiting = entry.waiting, []
        finished: list[FinishedSeq] = []
        for seq in waiting:
            if entry.ready:
                seq.status = SeqStatus.WAITING
                self.waiting.append(seq)
            else:
                self._finish(seq, "error", finished, entry.error)
        return finished

    def check_request(self, req: EngineRequest) -> str | None:
        """Why `req` can never run, or None. Limits are named in the message."""
        cfg = self.config
        if req.n < 1:
            return f"n must be >= 1, got {req.n}"
        taken = [req.seq_id + i for i in range(req.n) if req.seq_id + i in self.seqs]
        if taken:
            return f"duplicate sequence id {taken[0]}"
        if req.max_tokens < 1 or req.temperature < 0:
            return "max_tokens must be >= 1 and temperature >= 0"
        return prompt_limit_error(req.prompt_token_ids, cfg.max_model_len, cfg.block_size, cfg.num_kv_blocks,
                                  cfg.vocab_size)

    def abort(self, seq_ids: list[int]) -> list[FinishedSeq]:
        """End these requests (unknown or already finished ids are ignored)."""
        finished: list[FinishedSeq] = []
        for seq_id in seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                self._finish(seq, "abort", finished)
        return finished

    # ------------------------------------------------------------------ state
    @property
    def num_unfinished(self) -> int:
        return len(self.seqs)

    def stats(self) -> SchedulerStats:
        """The counts a metrics endpoint shows (`SchedulerStats` documents each)."""
        bm = self.block_manager
        compiling = sum(len(e.waiting) for e in self.grammars.entries.values())
        return SchedulerStats(len(self.running), len(self.waiting) + compiling, bm.num_blocks, bm.num_free_blocks,
                              self.num_preemptions, self.prefix_cache_queries, self.prefix_cache_hits)

    def can_schedule(self) -> bool:
        return len(self.in_flight) < self.config.max_steps_in_flight

    def _wants_tokens(self, seq: Sequence) -> bool:
        """Whether computing more of `seq` is useful: it may still sample another token."""
        return seq.num_output_tokens < seq.max_tokens and seq.num_tokens < self.config.max_model_len

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or return None when there is nothing to run or tell the workers."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        new_requests: list[NewRequest] = []
        resumed: list[ResumedRequest] = []
        prefill_seqs: list[Sequence] = []
        prefill_num_tokens: list[int] = []
        decode_seqs: list[Sequence] = []
        new_blocks: list[NewBlocks] = []
        preempted_ids: list[int] = []
        forks: list[ForkedRequest] = []
        forked: list[Sequence] = []  # join `running` after planning, sample after every row
        sampling: tuple[list[Sequence], ...] = ([], [], [], [], forked)  # new, resumed, prefill, decode rows, forks
        num_scheduled = 0

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        # This loop runs for every running request each step (256 rows at full batch): `_wants_tokens` and
        # `_advance` are written out, and the free blocks are counted only when the request lacks blocks: at 256
        # decode rows, schedule() went from 0.37 to about 0.2 ms (benchmarks/plan_size.py, the 2-core CI machine).
        running = self.running
        max_model_len = self.config.max_model_len
        block_size = self.config.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_tokens = len(seq.token_ids) + seq.num_pending_tokens
            if num_tokens - seq.num_prompt_tokens >= seq.max_tokens or num_tokens >= max_model_len:
                i += 1  # it may sample no more tokens (`_wants_tokens`)
                continue
            computed = seq.num_computed_tokens
            n = num_tokens - computed
            if n > budget:
                n = budget
            need = bm.num_new_blocks(seq, computed + n)
            if need and need > bm.num_free_blocks:
                while need > bm.num_free_blocks and running[-1] is not seq:
                    preempted_ids.append(self._preempt(running[-1]))
                if need > bm.num_free_blocks:  # `seq` is now the newest running request
                    if i == 0:
                        # Alone, and the whole cache cannot hold its next token: stop it there.
                        seq.max_tokens = seq.num_output_tokens
                        if seq.num_pending_tokens == 0:
                            self._finish(seq, "length", self.unreported)
                        else:
                            i += 1
                    else:
                        preempted_ids.append(self._preempt(seq))
                    continue
            if need:
                new_blocks.append(NewBlocks(seq.seq_id, i32(bm.append_blocks(seq, need))))
            computed += n  # `_advance(seq, n)`
            seq.num_computed_tokens = computed
            samples = computed == num_tokens
            if samples:
                seq.num_pending_tokens += 1
            if (computed if computed < len(seq.token_ids) else len(seq.token_ids)) // block_size > \
                    seq.num_hashed_blocks:
                bm.cache_full_blocks(seq)
            if samples and seq.num_unforked:
                self._fork(seq, forks, forked)
            if n == 1:
                decode_seqs.append(seq)
                if samples:
                    sampling[3].append(seq)
            else:
                prefill_seqs.append(seq)
                prefill_num_tokens.append(n)
                if samples:
                    sampling[2].append(seq)
            budget -= n
            num_scheduled += n
            i += 1

        # 2. Waiting requests in arrival order (preempted ones were put back at the front).
        if not preempted_ids:
            bs = self.config.block_size
            while self.waiting and budget > 0 and len(running) + len(forked) < self.config.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_pending_tokens:
                    break  # preempted while a step was in flight: wait for that token first
                cached = bm.find_cached_prefix(seq) if seq.use_prefix_cache else []
                num_computed = len(cached) * bs
                n = min(seq.num_tokens - num_computed, budget)
                if not bm.can_allocate(cached, num_computed + n):
                    break
                self.waiting.popleft()
                bm.allocate(seq, cached, num_computed + n)
                seq.num_computed_tokens = num_computed
                if seq.num_cached_tokens < 0:  # first admission
                    seq.num_cached_tokens = num_computed
                    seq.queue_time_s = max(0.0, time.time() - seq.arrival_time)
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += num_computed
                seq.status = SeqStatus.RUNNING
                running.append(seq)
                samples = self._advance(seq, n)
                if samples and seq.num_unforked:
                    self._fork(seq, forks, forked)
                if not seq.known_to_workers:
                    seq.known_to_workers = True
                    new_requests.append(NewRequest(
                        seq.seq_id, i32(seq.token_ids), seq.temperature, seq.seed, i32(seq.block_table),
                        num_computed, n, seq.options))
                    if samples:
                        sampling[0].append(seq)
                else:
                    resumed.append(ResumedRequest(seq.seq_id, i32(seq.block_table), num_computed, n))
                    if samples:
                        sampling[1].append(seq)
                budget -= n
                num_scheduled += n

        if num_scheduled == 0 and not self.finished_for_workers and not preempted_ids:
            return None
        # Constrained rows that sample their request's last token: the workers say if the grammar was left incomplete.
        check_grammar = [s.seq_id for rows in sampling for s in rows if s.grammar_id >= 0 and not self._wants_tokens(s)]
        plan = StepPlan(
            step_id=self.next_step_id if num_scheduled else -1,
            new_requests=new_requests,
            resumed_requests=resumed,
            prefill_seq_ids=i32([s.seq_id for s in prefill_seqs]),
            prefill_num_tokens=i32(prefill_num_tokens),
            decode_seq_ids=i32([s.seq_id for s in decode_seqs]),
            new_blocks=new_blocks,
            finished_seq_ids=i32(self.finished_for_workers),
            preempted_seq_ids=i32(preempted_ids),
            forked_requests=forks,
            check_grammar_seq_ids=i32(check_grammar),
        )
        running.extend(forked)
        self.finished_for_workers = []
        if num_scheduled:
            sampling_seqs = [s for rows in sampling for s in rows]
            self.in_flight.append(InFlightStep(self.next_step_id, sampling_seqs, num_scheduled))
            self.next_step_id += 1
        return plan

    def take_finished(self) -> list[FinishedSeq]:
        """Requests that ended during `schedule()` (not in any step's outputs); the caller reports them."""
        finished, self.unreported = self.unreported, []
        return finished

    def _advance(self, seq: Sequence, n: int) -> bool:
        """Account `n` scheduled tokens of `seq`; return whether its row samples a token."""
        seq.num_computed_tokens += n
        samples = seq.num_computed_tokens == seq.num_tokens
        if samples:
            seq.num_pending_tokens += 1
        if min(seq.num_computed_tokens, len(seq.token_ids)) // self.config.block_size > seq.num_hashed_blocks:
            self.block_manager.cache_full_blocks(seq)
        return samples

    def _fork(self, parent: Sequence, forks: list[ForkedRequest], forked: list[Sequence]) -> None:
        """Fork `parent`'s remaining samples in the step that computes its last prompt token (see the
        module docstring); those that do not fit go to the front of the waiting queue."""
        bm = self.block_manager
        num_full, partial = divmod(parent.num_prompt_tokens, self.config.block_size)
        while parent.num_unforked and len(self.running) + len(forked) < self.config.max_num_seqs and (
                not partial or bm.num_free_blocks > 0):
            fork = parent.make_fork()
            bm.fork(parent, fork, num_full, copy_last=bool(partial))
            fork.block_hashes = list(parent.block_hashes)
            fork.num_computed_tokens = parent.num_computed_tokens
            fork.num_pending_tokens = 1  # its first token, sampled in this step from the parent's logits
            fork.num_cached_tokens = parent.num_cached_tokens
            fork.status = SeqStatus.RUNNING
            fork.known_to_workers = True
            self._register_fork(fork)
            forked.append(fork)
            forks.append(ForkedRequest(fork.seq_id, parent.seq_id, fork.seed, i32(fork.block_table)))
        later = []
        while parent.num_unforked:
            fork = parent.make_fork()
            self._register_fork(fork)
            later.append(fork)
        self.waiting.extendleft(reversed(later))

    def _register_fork(self, fork: Sequence) -> None:
        self.seqs[fork.seq_id] = fork
        if fork.grammar_id >= 0:
            self.grammars.entries[fork.grammar_id].users += 1

    def _preempt(self, seq: Sequence) -> int:
        """Free `seq`'s blocks and put it at the front of the waiting queue (recompute later)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq.seq_id

    def _finish(self, seq: Sequence, reason: str, finished: list[FinishedSeq], error: str | None = None,
                structured_output_incomplete: bool = False) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.WAITING_FOR_GRAMMAR:
            waiting = self.grammars.entries[seq.grammar_id].waiting
            if seq in waiting:
                waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.block_manager.free(seq)
        if seq.known_to_workers:
            self.finished_for_workers.append(seq.seq_id)
        del self.seqs[seq.seq_id]
        if seq.grammar_id >= 0:
            self.grammars.release(seq.grammar_id)
        finished.append(FinishedSeq(seq.seq_id, reason, max(seq.num_cached_tokens, 0), error, seq.num_preemptions,
                                    seq.queue_time_s, structured_output_incomplete))
        while seq.num_unforked:  # samples never forked (it ended before its prompt did) end with it
            fork = seq.make_fork()
            finished.append(FinishedSeq(fork.seq_id, reason, 0, error, 0, seq.queue_time_s))

    # ------------------------------------------------------------------ results
    def process_result(self, result: StepResult) -> StepOutputs:
        """Apply the tokens sampled in the oldest in-flight step; finish requests that stop.

        Raises `RuntimeError` if the result does not match the step it claims to answer.
        """
        if not self.in_flight or self.in_flight[0].step_id != result.step_id:
            expected = self.in_flight[0].step_id if self.in_flight else None
            raise RuntimeError(f"step result {result.step_id} arrived, expected {expected}")
        step = self.in_flight.popleft()
        tokens = result.sampled_token_ids.tolist()
        if len(tokens) != len(step.sampling_seqs):
            raise RuntimeError(f"step {step.step_id}: {len(tokens)} tokens for {len(step.sampling_seqs)} sampling rows")
        out_ids: list[int] = []
        out_tokens: list[int] = []
        out_index = [-1] * len(tokens)  # sampling row -> its index in the outputs (-1: dropped)
        finished: list[FinishedSeq] = []
        cached: dict[int, int] = {}
        max_model_len = self.config.max_model_len
        bs = self.config.block_size
        incomplete = set(result.grammar_incomplete_seq_ids.tolist()) if len(result.grammar_incomplete_seq_ids) else ()
        for row, (seq, token) in enumerate(zip(step.sampling_seqs, tokens)):
            seq.num_pending_tokens -= 1
            if seq.status is SeqStatus.FINISHED:
                continue  # it stopped in an earlier step; this token was computed speculatively
            seq.token_ids.append(token)
            out_index[row] = len(out_ids)
            out_ids.append(seq.seq_id)
            out_tokens.append(token)
            if not seq.first_token_sent:
                seq.first_token_sent = True
                cached[seq.seq_id] = seq.num_cached_tokens
            num_tokens = len(seq.token_ids)
            if token in seq.stop_token_ids and num_tokens - seq.num_prompt_tokens > seq.min_tokens:
                self._finish(seq, "stop", finished)
            elif num_tokens - seq.num_prompt_tokens >= seq.max_tokens or num_tokens >= max_model_len:
                self._finish(seq, "length", finished, structured_output_incomplete=seq.seq_id in incomplete)
            elif (seq.num_computed_tokens if seq.num_computed_tokens < num_tokens else num_tokens) // bs > \
                    seq.num_hashed_blocks:  # min() written out, as in `schedule`
                self.block_manager.cache_full_blocks(seq)
        for seq_id, why in result.failed.items():
            seq = self.seqs.get(seq_id)
            if seq is not None:
                self._finish(seq, "error", finished, why)
        logprobs = _select_rows(result.logprobs, out_index) if result.logprobs is not None else None
        return StepOutputs(result.step_id, i32(out_ids), i32(out_tokens), finished, cached, logprobs,
                           result.prompt_logprobs)

    def check_invariants(self) -> None:
        """Block accounting invariants plus the scheduler's own (tests call this every step)."""
        live = list(self.seqs.values())
        self.block_manager.check_invariants(live)
        queued = {id(s) for s in self.waiting}
        users: dict[int, int] = {}
        for seq in live:
            if seq.grammar_id >= 0:
                users[seq.grammar_id] = users.get(seq.grammar_id, 0) + 1
            if seq.status in (SeqStatus.WAITING, SeqStatus.WAITING_FOR_GRAMMAR):
                assert not seq.block_table and seq.num_computed_tokens == 0, seq
                assert (seq.status is SeqStatus.WAITING) == (id(seq) in queued), seq
            else:
                assert seq.num_computed_tokens <= seq.num_tokens, seq
                assert len(seq.block_table) == self.block_manager.blocks_needed(seq.num_computed_tokens), seq
        assert {gid: e.users for gid, e in self.grammars.entries.items() if e.users} == users, users
        if not live:
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks


def _select_rows(lp: Logprobs, new_index: list[int]) -> Logprobs | None:
    """`lp` with each row r renamed `new_index[r]`, and rows whose new index is -1 left out (None if none
    is left). Its rows hold one position each (sampled tokens)."""
    rows = lp.rows.tolist()
    keep = [i for i, r in enumerate(rows) if new_index[r] >= 0]
    if not keep:
        return None
    if len(keep) == len(rows):
        return Logprobs(i32([new_index[r] for r in rows]), *[getattr(lp, f) for f in _LOGPROBS_FIELDS[1:]])
    top_start = np.concatenate([[0], np.cumsum(lp.num_top)]).astype(np.int64)
    top_keep = np.concatenate([np.arange(top_start[i], top_start[i + 1]) for i in keep]).astype(np.int64)
    return Logprobs(i32([new_index[rows[i]] for i in keep]), lp.counts[keep], lp.num_top[keep],
                    lp.token_logprobs[keep], lp.ranks[keep], lp.top_token_ids[top_keep], lp.top_logprobs[top_keep])


_LOGPROBS_FIELDS = ("rows", "counts", "num_top", "token_logprobs", "ranks", "top_token_ids", "top_logprobs")
