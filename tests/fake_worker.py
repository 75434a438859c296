"""A model-free worker that makes KV-cache bugs visible: the real `Scheduler` and `InputBatch` around a
content hash model.

`FakeEngine` runs the scheduler process's loop and the worker process's loop in one thread, in the
order the real processes use (`scheduler_proc/process.py`, `workers/process.py`), with every plan
and result going through the wire codec. Only the model is replaced:

- The KV cache is one int64 per slot (`num_blocks * block_size`), -1 until written. A step stores
  each scheduled token's id into its slot, for all rows first, as every attention layer stores the
  batch's K/V before it attends.
- The KV entry of position p also carries a fingerprint of the ids its writer read at positions
  0..p through the writer's block table (a real K/V vector depends on the whole prefix). A block
  shared between sequences whose prefixes differ is therefore caught even when its own ids agree.
- "Attention" of a row reads positions 0..seq_len-1 through the row's block table
  (`InputBatch.block_table[row]`): every slot must be written, hold the sequence's token and a
  fingerprint of this same prefix. A sampling row then emits
  ``xxh64(context ids as int32 bytes) % vocab_size``: the output is a pure function of the token
  sequence, the same under any batching, chunking, prefix caching or preemption, and any wrong or
  stale KV block changes it (`reference_output` computes it directly).

Cross-process checks on every step: the worker's rows, their start positions, block tables and
sampling rows equal what the scheduler planned; input ids (host or "device" last-sampled) equal the
sequence's tokens; slots are unique and inside the sequence's own blocks; every hash-table entry
points at a block whose cache content is the hashed tokens. `Scheduler.check_invariants` runs after
every schedule and every processed result.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from common.protocol import (
    EngineRequest,
    FinishedSeq,
    StepOutputs,
    StepPlan,
    StepResult,
    decode,
    encode,
    i32,
)
from scheduler_proc.scheduler import Scheduler, SchedulerConfig
from workers.input_batch import InputBatch
from workers.request_state import ReqState

VOCAB_SIZE = 50_000

_MASK64 = (1 << 64) - 1
_FP_BASE = 0x9E37_79B9_7F4A_7C15  # odd, so invertible modulo 2**64
_FP_BASE_INV = pow(_FP_BASE, -1, 1 << 64)


def next_token(context: Sequence[int] | np.ndarray, vocab_size: int = VOCAB_SIZE) -> int:
    """The hash model: the token that follows `context` (all tokens so far)."""
    return xxhash.xxh64_intdigest(np.asarray(context, dtype="<i4").tobytes()) % vocab_size


def reference_output(
    prompt: Sequence[int],
    max_tokens: int,
    *,
    max_model_len: int,
    stop_token_ids: Iterable[int] = (),
    vocab_size: int = VOCAB_SIZE,
    kv_capacity_tokens: int | None = None,
) -> tuple[list[int], str]:
    """Output token ids and finish reason of the hash model run autoregressively on `prompt`.

    token_k = next_token(prompt + tokens_<k). Stops after a stop token ("stop"), at `max_tokens`
    outputs or `max_model_len` total tokens ("length"), or ("length") when the whole cache cannot
    hold the next step's KV: sampling after L tokens writes position L - 1, so it needs L slots and
    stops once L > `kv_capacity_tokens`.
    """
    stops = set(stop_token_ids)
    tokens = list(prompt)
    out: list[int] = []
    while True:
        if kv_capacity_tokens is not None and len(tokens) > kv_capacity_tokens:
            return out, "length"
        token = next_token(tokens, vocab_size)
        tokens.append(token)
        out.append(token)
        if token in stops:
            return out, "stop"
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out, "length"


def make_request(seq_id: int, prompt: Sequence[int], max_tokens: int, stop_token_ids: Iterable[int] = (),
                 temperature: float = 0.0, n: int = 1) -> EngineRequest:
    """A request as the frontend sends it (greedy by default; no stop ids = ignore_eos). Its n samples
    have seq ids seq_id .. seq_id + n - 1: the hash model gives all of them sample 0's output."""
    return EngineRequest(seq_id, i32(prompt), temperature, max_tokens, None, list(stop_token_ids), float(seq_id),
                         n=n)


def synthetic_prompt(num_tokens: int, seed: int, low: int = 1000, high: int = 20000) -> list[int]:
    """`num_tokens` ids from a fixed-seed RNG in [low, high) (scenarios.md's synthetic prompt)."""
    return np.random.default_rng(seed).integers(low, high, size=num_tokens).tolist()


def prefix_fingerprints(ids: np.ndarray) -> np.ndarray:
    """[n] uint64: entry p is sum_{i<=p} (ids[i] + 1) * BASE**(p - i) mod 2**64, for p in 0..n-1."""
    n = len(ids)
    weights = (ids.astype(np.uint64) + np.uint64(1)) * _powers(_FP_BASE_INV, n)
    return np.cumsum(weights, dtype=np.uint64) * _powers(_FP_BASE, n)


_POWERS: dict[int, np.ndarray] = {}


def _powers(base: int, n: int) -> np.ndarray:
    cached = _POWERS.get(base)
    if cached is None or len(cached) < n:
        size = max(n, 2 * len(cached) if cached is not None else 1024)
        values, x = [], 1
        for _ in range(size):
            values.append(x)
            x = x * base & _MASK64
        cached = _POWERS[base] = np.array(values, dtype=np.uint64)
    return cached[:n]


# ============================================================================ records
@dataclass(frozen=True)
class Row:
    """One row of a step as the scheduler planned it (row order of the plan)."""

    seq_id: int
    kind: str  # "new", "resumed", "prefill" or "decode"
    start: int  # first position computed (tokens whose KV already exists, cached prefix included)
    num_tokens: int  # tokens computed this step
    known_tokens: int  # tokens the workers know of before this step (prompt + sampled, in flight too)
    block_table: tuple[int, ...]  # the sequence's whole block table after planning

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.known_tokens


@dataclass
class StepRecord:
    """What one `schedule()` produced, with the scheduler state right after it."""

    plan: StepPlan
    rows: list[Row]
    sampling_seq_ids: list[int]  # the rows the scheduler expects to sample, in row order
    block_table_lens: dict[int, int]  # every running sequence's block table length
    num_free_blocks: int
    num_preemptions: int  # cumulative, scheduler-wide
    num_running: int
    num_waiting: int
    running_before: list[int]  # running sequences, oldest first, when this step was planned
    seq_lens: list[int] = field(default_factory=list)  # key length of each row, filled by the worker

    @property
    def step_id(self) -> int:
        return self.plan.step_id

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def preempted_seq_ids(self) -> list[int]:
        return self.plan.preempted_seq_ids.tolist()

    @property
    def admitted_seq_ids(self) -> list[int]:
        return [r.seq_id for r in self.rows if r.kind in ("new", "resumed")]


@dataclass
class ResultRecord:
    """One processed `StepResult`, with each live sequence's (prompt, outputs, blocks) after it."""

    outputs: StepOutputs
    seqs: dict[int, tuple[int, int, int]]  # seq_id -> (prompt tokens, received outputs, block table length)
    num_in_flight: int


# ============================================================================ the worker
@dataclass
class FakeStep:
    """A launched step whose sampled tokens have not reached the "host" yet."""

    step_id: int
    states: list[ReqState]
    tokens: np.ndarray  # [S] int32, row order


class FakeWorker:
    """A worker whose model is the content hash model; see the module docstring."""

    def __init__(self, config: SchedulerConfig, vocab_size: int = VOCAB_SIZE) -> None:
        bs = config.block_size
        self.block_size = bs
        self.vocab_size = vocab_size
        max_blocks_per_seq = -(-config.max_model_len // bs)
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, max_blocks_per_seq, bs)
        self.kv_tokens = np.full(config.num_kv_blocks * bs, -1, dtype=np.int64)
        self.kv_fingerprints = np.zeros(config.num_kv_blocks * bs, dtype=np.uint64)
        self.last_sampled = np.zeros(config.max_num_seqs, dtype=np.int64)  # the "device" copy, per row
        self.truth: dict[int, list[int]] = {}  # seq_id -> prompt + every token this worker sampled

    def execute(self, plan: StepPlan, expected: StepRecord) -> FakeStep | None:
        """Apply `plan`, check it against the scheduler's view, run it; None when it has no rows."""
        for seq_id in plan.finished_seq_ids.tolist():
            self.truth.pop(seq_id, None)
        for req in plan.new_requests:
            self.truth[req.seq_id] = req.prompt_token_ids.tolist()
        scheduled = self.batch.apply(plan)
        for fork, parent in self.batch.forks:
            self.truth[fork.seq_id] = self.truth[parent.seq_id][: parent.num_prompt_tokens]
        got_rows = [(st.seq_id, n) for st, n in scheduled]
        want_rows = [(r.seq_id, r.num_tokens) for r in expected.rows]
        assert got_rows == want_rows, f"step {plan.step_id}: worker rows {got_rows} != scheduler rows {want_rows}"
        if not scheduled:
            return None
        inputs = self.batch.prepare(scheduled)
        bs = self.block_size
        qsl = inputs.query_start_loc.tolist()
        seq_lens = inputs.seq_lens.tolist()
        expected.seq_lens = seq_lens
        sampling_ids = [st.seq_id for st in inputs.sampling_states]
        assert sampling_ids == expected.sampling_seq_ids, (
            f"step {plan.step_id}: worker samples rows of {sampling_ids}, "
            f"scheduler expects {expected.sampling_seq_ids}")
        assert len(inputs.logits_indices) == len(sampling_ids)

        ids = inputs.input_ids.copy()
        ids[inputs.gpu_token_index] = self.last_sampled[inputs.gpu_token_rows]  # what the device does
        slots = inputs.slot_mapping
        assert len(np.unique(slots)) == len(slots), f"step {plan.step_id}: two tokens write the same slot"
        tables: list[np.ndarray] = []
        for b, ((st, n), row) in enumerate(zip(scheduled, expected.rows)):
            table = self.batch.block_table[st.row, : st.num_blocks].copy()
            assert tuple(table.tolist()) == row.block_table, (
                f"step {plan.step_id} seq {st.seq_id}: worker block table {table.tolist()} != scheduler's "
                f"{list(row.block_table)}")
            lo, hi = qsl[b], qsl[b + 1]
            start = int(inputs.positions[lo])
            assert start == row.start, (
                f"step {plan.step_id} seq {st.seq_id}: worker computes from position {start}, scheduler planned "
                f"{row.start}")
            assert seq_lens[b] == start + n, (
                f"step {plan.step_id} seq {st.seq_id}: key length {seq_lens[b]} != {start} computed + {n} new")
            assert (start + n - 1) // bs < len(table), (
                f"step {plan.step_id} seq {st.seq_id}: position {start + n - 1} is past its {len(table)} blocks")
            pos = np.arange(start, start + n)
            assert (inputs.positions[lo:hi] == pos).all()
            own = table[pos // bs].astype(np.int64) * bs + pos % bs
            assert (slots[lo:hi] == own).all() and (own >= 0).all(), (
                f"step {plan.step_id} seq {st.seq_id}: slots {slots[lo:hi].tolist()} are not its own {own.tolist()}")
            truth = self.truth[st.seq_id]
            assert ids[lo:hi].tolist() == truth[start:start + n], (
                f"step {plan.step_id} seq {st.seq_id}: input ids {ids[lo:hi].tolist()} != its tokens "
                f"{truth[start:start + n]}")
            tables.append(table)

        # Store K/V (token ids) of the whole batch, then each row's fingerprints from what it reads.
        self.kv_tokens[slots] = ids
        contexts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for b, ((st, n), table) in enumerate(zip(scheduled, tables)):
            length = seq_lens[b]
            pos = np.arange(length)
            ctx_slots = table[pos // bs].astype(np.int64) * bs + pos % bs
            ctx = self.kv_tokens[ctx_slots]
            unwritten = np.flatnonzero(ctx < 0)
            assert not len(unwritten), (
                f"step {plan.step_id} seq {st.seq_id}: attention reads unwritten positions {unwritten[:8].tolist()} "
                f"(key length {length})")
            truth = self.truth[st.seq_id]
            wrong = np.flatnonzero(ctx != np.asarray(truth[:length]))
            assert not len(wrong), (
                f"step {plan.step_id} seq {st.seq_id}: KV at positions {wrong[:8].tolist()} holds other tokens "
                f"(blocks {table.tolist()})")
            fps = prefix_fingerprints(ctx)
            start = length - n
            self.kv_fingerprints[ctx_slots[start:]] = fps[start:]
            contexts.append((ctx_slots, ctx, fps))
        for (st, _), (ctx_slots, _, fps) in zip(scheduled, contexts):
            stale = np.flatnonzero(self.kv_fingerprints[ctx_slots] != fps)
            assert not len(stale), (
                f"step {plan.step_id} seq {st.seq_id}: KV at positions {stale[:8].tolist()} was computed for "
                f"another prefix")

        # Copy-on-write of forked samples: each fork's last prompt block gets its parent's (as the model
        # runner copies the KV after the forward).
        for fork, parent in inputs.forks:
            n = parent.num_prompt_tokens
            if n % bs:
                src = int(self.batch.block_table[parent.row, n // bs])
                dst = int(self.batch.block_table[fork.row, n // bs])
                assert src != dst, f"fork {fork.seq_id} shares the partial block {src} of its parent"
                self.kv_tokens[dst * bs:(dst + 1) * bs] = self.kv_tokens[src * bs:(src + 1) * bs]
                self.kv_fingerprints[dst * bs:(dst + 1) * bs] = self.kv_fingerprints[src * bs:(src + 1) * bs]
        row_of = {id(st): b for b, (st, _) in enumerate(scheduled)}
        row_of.update({id(fork): row_of[id(parent)] for fork, parent in inputs.forks})  # the parent's logits
        tokens = np.array([next_token(contexts[row_of[id(st)]][1], self.vocab_size) for st in inputs.sampling_states],
                          dtype=np.int32)
        self.last_sampled[inputs.sampling_rows] = tokens
        for st, token in zip(inputs.sampling_states, tokens.tolist()):
            self.truth[st.seq_id].append(token)
        return FakeStep(plan.step_id, inputs.sampling_states, tokens)

    def finalize(self, step: FakeStep) -> StepResult:
        """The step's tokens reach the host: record them in the batch, build the result."""
        InputBatch.append_sampled(step.states, step.tokens)
        return StepResult(step.step_id, i32(step.tokens))

    def check_hashed_blocks(self, scheduler: Scheduler) -> None:
        """Every prefix-cache entry points at a block whose KV holds the hashed tokens (all plans executed)."""
        bm = scheduler.block_manager
        if not bm.hash_to_block_id:
            return
        block_ids = np.fromiter(bm.hash_to_block_id.values(), np.int64)
        want = np.frombuffer(b"".join(bm.blocks[b].token_ids for b in block_ids.tolist()), "<i4").reshape(
            len(block_ids), self.block_size)
        have = self.kv_tokens.reshape(-1, self.block_size)[block_ids]
        bad = np.flatnonzero((have != want).any(axis=1))
        assert not len(bad), f"hash entries point at blocks {block_ids[bad].tolist()} whose KV holds other tokens"


# ============================================================================ the two loops
class FakeEngine:
    """The scheduler loop and the worker loop, one iteration each per `step()`.

    Scheduler iteration (scheduler_proc/process.py): process every result that arrived, then plan
    while `can_schedule()`. Worker iteration (workers/process.py): for each plan, launch it, then
    finalize the previously launched step. When no plan is waiting, `interleaving` decides when the
    launched step is finalized:
    - "lazy" (default, a device slower than the scheduler): one iteration later, so the scheduler
      plans the next step while this one is in flight, and receives results one at a time; it is
      finalized at once only if the scheduler planned nothing meanwhile;
    - "eager" (a device faster than the scheduler): at once, so two planned steps' results reach
      the scheduler together;
    - a `random.Random`: lazy or eager at random, each time.

    A step is finalized exactly once. (The real loop in workers/process.py keeps a finalized step as
    pending after a plan without rows and sends its result twice; see
    test_worker_loop_sends_each_step_result_once_when_a_plan_has_no_rows.)
    """

    def __init__(self, config: SchedulerConfig, *, vocab_size: int = VOCAB_SIZE, check_invariants: bool = True,
                 interleaving: str | random.Random = "lazy") -> None:
        assert interleaving in ("lazy", "eager") or isinstance(interleaving, random.Random), interleaving
        self.config = config
        self.vocab_size = vocab_size
        self.check = check_invariants
        self.interleaving = interleaving
        self.scheduler = Scheduler(config)
        self.worker = FakeWorker(config, vocab_size)
        self.to_worker: deque[tuple[bytes, StepRecord]] = deque()
        self.to_scheduler: deque[bytes] = deque()
        self.pending: FakeStep | None = None
        self.deferred = False
        self.requests: dict[int, EngineRequest] = {}
        self.outputs: dict[int, list[int]] = {}
        self.finished: dict[int, FinishedSeq] = {}
        self.first_token_cached: dict[int, int] = {}  # StepOutputs.num_cached_tokens, on the first token
        self.steps: list[StepRecord] = []  # every plan, rows or not
        self.results: list[ResultRecord] = []
        self.plan_sizes: list[int] = []  # encoded bytes of every plan
        self.num_events = 0  # plans, results, deferrals: progress of the two loops

    # ------------------------------------------------------------------ frontend side
    def add(self, req: EngineRequest) -> FinishedSeq | None:
        for i in range(req.n):  # a request's samples: one output each, all expected to equal sample 0's
            self.requests[req.seq_id + i] = req
            self.outputs[req.seq_id + i] = []
        errors = self.scheduler.add_request(req)
        for error in errors:
            self._record_finished(error)
        self._check()
        return errors[0] if errors else None

    def abort(self, seq_ids: list[int]) -> list[FinishedSeq]:
        finished = self.scheduler.abort(seq_ids)
        for fin in finished:
            self._record_finished(fin)
        self._check()
        return finished

    # ------------------------------------------------------------------ loops
    def step(self) -> None:
        self.scheduler_iteration()
        self.worker_iteration()

    def scheduler_iteration(self, max_results: int | None = None) -> None:
        """One pass of the scheduler loop; `max_results` limits the results that have "arrived" so far."""
        sched = self.scheduler
        for _ in range(len(self.to_scheduler) if max_results is None else min(max_results, len(self.to_scheduler))):
            outputs = sched.process_result(decode(self.to_scheduler.popleft()))
            self._record_outputs(outputs)
            self._check()
        while sched.can_schedule():
            running_before = [s.seq_id for s in sched.running]
            plan = sched.schedule()
            if plan is None:
                break
            record = self._record_plan(plan, running_before)
            self._check()
            data = encode(plan)
            self.plan_sizes.append(len(data))
            self.num_events += 1
            self.to_worker.append((data, record))
        ended_while_planning = sched.take_finished()
        if ended_while_planning:
            self._record_outputs(StepOutputs(step_id=-1, finished=ended_while_planning))
        unforked = {seq.seq_id + i for seq in sched.seqs.values()  # samples n > 1 still to fork from a live seq
                    for i in range(seq.next_fork_index, seq.next_fork_index + seq.num_unforked)}
        lost = [s for s in self.requests if s not in self.finished and s not in sched.seqs and s not in unforked]
        assert not lost, f"requests {lost} left the scheduler without a FinishedSeq: the client would wait forever"

    def worker_iteration(self) -> None:
        while self.to_worker:
            data, record = self.to_worker.popleft()
            launched = self.worker.execute(decode(data), record)
            if self.pending is not None:
                self._send_result(self.pending)
            self.pending = launched
            self.deferred = False
        if self.pending is not None:
            mode = self.interleaving
            eager = mode == "eager" or (isinstance(mode, random.Random) and mode.random() < 0.5)
            if eager or self.deferred:
                self._send_result(self.pending)
                self.pending = None
                self.deferred = False
            else:
                self.deferred = True
                self.num_events += 1
        if self.check:
            self.worker.check_hashed_blocks(self.scheduler)

    def _send_result(self, step: FakeStep) -> None:
        self.num_events += 1
        self.to_scheduler.append(encode(self.worker.finalize(step)))

    @property
    def done(self) -> bool:
        sched = self.scheduler
        return not (sched.seqs or sched.in_flight or sched.finished_for_workers or self.to_worker
                    or self.to_scheduler or self.pending)

    def run_until_done(self, max_steps: int = 20_000) -> FakeEngine:
        """Step until every request has finished and the workers forgot them all.

        Raises `AssertionError` after `max_steps` planned steps (a livelock), or when an iteration
        changes nothing while requests remain (a hang).
        """
        while not self.done:
            before = self.num_events
            self.step()
            if self.num_events == before and not self.done:
                raise AssertionError(f"stuck: nothing is planned or computed; {self.describe()}")
            if self.num_steps > max_steps:
                raise AssertionError(f"no completion after {max_steps} steps (livelock?); {self.describe()}")
        if self.check:
            self.check_all_released()
        return self

    def check_all_released(self) -> None:
        """BAI (4) and no per-request state left on either side."""
        sched, bm = self.scheduler, self.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks still used"
        assert all(b.ref_count == 0 for b in bm.blocks)
        assert not sched.seqs and not sched.waiting and not sched.running and not sched.in_flight
        assert not self.worker.batch.reqs, f"the worker still holds {sorted(self.worker.batch.reqs)}"
        assert sorted(self.worker.batch._free_rows) == list(range(self.config.max_num_seqs))
        assert set(self.finished) == set(self.requests)

    def describe(self) -> str:
        sched = self.scheduler
        return (f"waiting {list(sched.waiting)}, running {sched.running}, in flight "
                f"{[s.step_id for s in sched.in_flight]}, free blocks {sched.block_manager.num_free_blocks}, "
                f"preemptions {sched.num_preemptions}")

    # ------------------------------------------------------------------ observations
    @property
    def num_steps(self) -> int:
        """Planned steps that compute something."""
        return sum(1 for s in self.steps if s.rows)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def finish_reasons(self) -> dict[int, str]:
        return {s: f.reason for s, f in self.finished.items()}

    @property
    def num_cached_tokens(self) -> dict[int, int]:
        return {s: f.num_cached_tokens for s, f in self.finished.items()}

    def reference(self, seq_id: int) -> tuple[list[int], str]:
        """The expected (outputs, finish reason) of a request, or ([], "error") if it can never run."""
        req, cfg = self.requests[seq_id], self.config
        n = len(req.prompt_token_ids)
        if n == 0 or n >= cfg.max_model_len or -(-n // cfg.block_size) > cfg.num_kv_blocks:
            return [], "error"
        return reference_output(req.prompt_token_ids.tolist(), req.max_tokens, max_model_len=cfg.max_model_len,
                                stop_token_ids=req.stop_token_ids, vocab_size=self.vocab_size,
                                kv_capacity_tokens=cfg.num_kv_blocks * cfg.block_size)

    def assert_matches_reference(self) -> None:
        for seq_id in self.requests:
            want_tokens, want_reason = self.reference(seq_id)
            assert self.outputs[seq_id] == want_tokens, (
                f"seq {seq_id}: {len(self.outputs[seq_id])} tokens {self.outputs[seq_id][:8]}... != reference "
                f"{len(want_tokens)} tokens {want_tokens[:8]}...")
            assert self.finished[seq_id].reason == want_reason, (seq_id, self.finished[seq_id], want_reason)

    def _check(self) -> None:
        if self.check:
            self.scheduler.check_invariants()

    def _record_plan(self, plan: StepPlan, running_before: list[int]) -> StepRecord:
        sched = self.scheduler
        rows: list[Row] = []

        def add(seq_id: int, kind: str, n: int) -> None:
            seq = sched.seqs[seq_id]
            start = seq.num_computed_tokens - n
            samples = any(s is seq for s in sampling)
            known = seq.num_tokens - (1 if samples else 0)
            rows.append(Row(seq_id, kind, start, n, known, tuple(seq.block_table)))

        sampling = sched.in_flight[-1].sampling_seqs if plan.step_id >= 0 else []
        forked = {f.seq_id for f in plan.forked_requests}
        for r in plan.new_requests:
            add(r.seq_id, "new", r.num_scheduled_tokens)
        for r in plan.resumed_requests:
            add(r.seq_id, "resumed", r.num_scheduled_tokens)
        for seq_id, n in zip(plan.prefill_seq_ids.tolist(), plan.prefill_num_tokens.tolist()):
            add(seq_id, "prefill", n)
        for seq_id in plan.decode_seq_ids.tolist():
            add(seq_id, "decode", 1)
        record = StepRecord(
            plan=plan,
            rows=rows,
            sampling_seq_ids=[s.seq_id for s in sampling],
            block_table_lens={s.seq_id: len(s.block_table) for s in sched.running},
            num_free_blocks=sched.block_manager.num_free_blocks,
            num_preemptions=sched.num_preemptions,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            running_before=running_before,
        )
        assert [r.seq_id for r in rows if r.samples] == [s for s in record.sampling_seq_ids if s not in forked]
        assert record.sampling_seq_ids[len(record.sampling_seq_ids) - len(forked):] == [
            f.seq_id for f in plan.forked_requests], "forks sample after every row, in plan order"
        self.steps.append(record)
        return record

    def _record_outputs(self, outputs: StepOutputs) -> None:
        for seq_id, token in zip(outputs.seq_ids.tolist(), outputs.token_ids.tolist()):
            assert seq_id not in self.finished, f"seq {seq_id} got a token after it finished"
            self.outputs[seq_id].append(token)
        for seq_id, cached in outputs.num_cached_tokens.items():
            assert seq_id not in self.first_token_cached, f"seq {seq_id}: num_cached_tokens reported twice"
            assert self.outputs[seq_id], f"seq {seq_id}: num_cached_tokens before its first token"
            self.first_token_cached[seq_id] = cached
        for fin in outputs.finished:
            self._record_finished(fin)
        sched = self.scheduler
        self.results.append(ResultRecord(
            outputs,
            {s.seq_id: (s.num_prompt_tokens, len(s.token_ids) - s.num_prompt_tokens, len(s.block_table))
             for s in sched.seqs.values()},
            len(sched.in_flight)))

    def _record_finished(self, fin: FinishedSeq) -> None:
        assert fin.seq_id not in self.finished, f"seq {fin.seq_id} finished twice"
        self.finished[fin.seq_id] = fin
        if fin.seq_id in self.first_token_cached:
            assert fin.num_cached_tokens == self.first_token_cached[fin.seq_id], fin


def run(requests: Iterable[EngineRequest], config: SchedulerConfig, *, vocab_size: int = VOCAB_SIZE,
        check_invariants: bool = True, max_steps: int = 20_000,
        interleaving: str | random.Random = "lazy") -> FakeEngine:
    """Add `requests` (all at once), run until every one has finished; return the engine to inspect."""
    engine = FakeEngine(config, vocab_size=vocab_size, check_invariants=check_invariants, interleaving=interleaving)
    for req in requests:
        engine.add(req)
    return engine.run_until_done(max_steps)
