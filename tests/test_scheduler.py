"""Scheduler policy, driven through the real scheduler and worker state by the fake worker.

Every run below checks, after every schedule and every result, the block accounting invariants
and that the worker computes exactly the rows, positions, block tables and sampling rows the
scheduler planned (tests/fake_worker.py); outputs are compared with the hash model's reference.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common import ipc
from common.protocol import StepPlan, StepResult, decode, encode, i32
from scheduler_proc.scheduler import Scheduler, SchedulerConfig
from tests.fake_worker import FakeEngine, make_request, reference_output, run, synthetic_prompt


def config(**overrides: object) -> SchedulerConfig:
    values: dict = dict(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    values.update(overrides)
    return SchedulerConfig(**values)


def rows_of(engine: FakeEngine, seq_id: int) -> list[tuple[int, str, int, int]]:
    """(step id, kind, start, tokens) of every row of `seq_id`, in step order."""
    return [(s.step_id, r.kind, r.start, r.num_tokens) for s in engine.steps for r in s.rows if r.seq_id == seq_id]


def assert_step_limits_hold(engine: FakeEngine) -> None:
    """Budget, max_num_seqs, BR-06's bound, no KV past the final length, oldest-first preemption and no
    admission in a preempting step."""
    cfg = engine.config
    for s in engine.steps:
        assert s.num_scheduled_tokens <= cfg.max_num_batched_tokens, s
        assert s.num_running <= cfg.max_num_seqs and len(s.rows) <= cfg.max_num_seqs, s
        for r in s.rows:
            assert r.num_tokens >= 1 and r.start + r.num_tokens <= r.known_tokens, r
            req = engine.requests[r.seq_id]
            final_len = min(cfg.max_model_len, len(req.prompt_token_ids) + req.max_tokens)
            assert r.start + r.num_tokens <= final_len - 1, f"step {s.step_id} computes past the final token: {r}"
        if s.preempted_seq_ids:
            assert not s.admitted_seq_ids, f"step {s.step_id} preempted {s.preempted_seq_ids} and admitted"
            assert s.running_before[0] not in s.preempted_seq_ids, f"step {s.step_id} preempted the oldest"


# ============================================================================ budget and batch size
@pytest.mark.parametrize("budget", [1, 5, 16, 100])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_every_step_stays_within_the_token_budget_and_max_num_seqs(budget: int, max_num_seqs: int) -> None:
    reqs = [make_request(i, synthetic_prompt(5 + 7 * i, seed=i), max_tokens=6) for i in range(10)]
    engine = run(reqs, config(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, num_kv_blocks=40))

    engine.assert_matches_reference()
    assert_step_limits_hold(engine)
    if budget <= 16:
        assert max(s.num_scheduled_tokens for s in engine.steps) == budget


def test_admission_stops_at_max_num_seqs() -> None:
    reqs = [make_request(i, synthetic_prompt(4, seed=i), max_tokens=3) for i in range(12)]
    engine = run(reqs, config(max_num_seqs=5))

    assert engine.steps[0].admitted_seq_ids == [0, 1, 2, 3, 4]
    assert max(s.num_running for s in engine.steps) == 5
    engine.assert_matches_reference()


# ============================================================================ chunked prefill
def test_long_prompt_is_prefilled_in_budget_sized_chunks_and_samples_only_at_the_end() -> None:
    engine = run([make_request(0, synthetic_prompt(50, seed=1), max_tokens=3)], config(max_num_batched_tokens=16))

    assert rows_of(engine, 0) == [
        (0, "new", 0, 16), (1, "prefill", 16, 16), (2, "prefill", 32, 16), (3, "prefill", 48, 2),
        (4, "decode", 50, 1), (5, "decode", 51, 1),
    ]
    assert [s.sampling_seq_ids for s in engine.steps[:4]] == [[], [], [], [0]]
    engine.assert_matches_reference()


def test_later_request_is_chunked_while_an_earlier_one_decodes_in_the_same_step() -> None:
    engine = FakeEngine(config(max_num_batched_tokens=16))
    engine.add(make_request(0, synthetic_prompt(8, seed=1), max_tokens=10))
    engine.step()
    engine.add(make_request(1, synthetic_prompt(40, seed=2), max_tokens=4))
    engine.run_until_done()

    b_rows = rows_of(engine, 1)
    assert [(kind, start, n) for _, kind, start, n in b_rows[:3]] == [("new", 0, 15), ("prefill", 15, 15),
                                                                      ("prefill", 30, 10)]
    mixed = [s for s in engine.steps if {(r.seq_id, r.kind) for r in s.rows} >= {(0, "decode"), (1, "prefill")}]
    assert len(mixed) == 2
    assert all(s.num_scheduled_tokens <= 16 for s in engine.steps)
    engine.assert_matches_reference()


# ============================================================================ preemption
def test_preempted_request_resumes_with_its_own_cached_blocks() -> None:
    # 9 blocks of 4: both requests grow until the older one needs a block and the newer is preempted.
    reqs = [make_request(0, synthetic_prompt(8, seed=0), 12), make_request(1, synthetic_prompt(8, seed=1), 20)]
    engine = run(reqs, config(num_kv_blocks=9))

    (preempting,) = [s for s in engine.steps if s.preempted_seq_ids]
    assert preempting.preempted_seq_ids == [1] and 0 in [r.seq_id for r in preempting.rows]
    table_before = next(r.block_table for s in reversed(engine.steps) if 0 <= s.step_id < preempting.step_id
                        for r in s.rows if r.seq_id == 1)
    (resumed,) = [r for s in engine.steps for r in s.rows if r.kind == "resumed"]
    assert resumed.start == 16 and resumed.num_tokens == resumed.known_tokens - 16
    assert resumed.block_table[:4] == table_before[:4]
    assert engine.num_cached_tokens[1] == 0  # num_cached_tokens counts the first admission only
    engine.assert_matches_reference()


def test_preempted_request_is_readmitted_before_later_arrivals() -> None:
    reqs = [make_request(0, synthetic_prompt(8, seed=0), 12), make_request(1, synthetic_prompt(8, seed=1), 20),
            make_request(2, synthetic_prompt(8, seed=2), 4)]
    engine = run(reqs, config(num_kv_blocks=9, max_num_seqs=2))

    assert [(s.step_id, s.preempted_seq_ids) for s in engine.steps if s.preempted_seq_ids] == [(9, [1])]
    resumed_at = next(s.step_id for s in engine.steps for r in s.rows if r.seq_id == 1 and r.kind == "resumed")
    admitted_at = next(s.step_id for s in engine.steps if 2 in s.admitted_seq_ids)
    assert resumed_at <= admitted_at
    engine.assert_matches_reference()


def test_preempted_request_waits_for_its_token_in_flight_before_it_resumes() -> None:
    """The workers can resume a request only once its last sampled token reached their host side.

    Reachable with three steps in flight (the scheduler allows it; the engine uses two) and one
    result at a time: request 1 is preempted while its token of step 3 is in flight, then every
    block is freed and the result of step 2 (without that token) arrives.
    """
    engine = FakeEngine(config(num_kv_blocks=4, max_num_batched_tokens=4, max_steps_in_flight=3))
    engine.add(make_request(0, synthetic_prompt(4, seed=0), 30))
    engine.add(make_request(1, synthetic_prompt(8, seed=1), 20))
    while not engine.scheduler.num_preemptions:
        engine.worker_iteration()
        engine.scheduler_iteration(max_results=1)
    preempted = engine.scheduler.seqs[1]
    assert preempted in engine.scheduler.waiting and preempted.num_pending_tokens == 1
    assert preempted not in engine.scheduler.in_flight[0].sampling_seqs

    engine.abort([0])
    engine.worker_iteration()
    engine.scheduler_iteration(max_results=1)

    assert preempted in engine.scheduler.waiting and preempted.num_pending_tokens == 1
    engine.run_until_done()
    assert engine.outputs[1] == engine.reference(1)[0]


def test_oldest_request_keeps_running_and_preempting_steps_admit_nobody() -> None:
    reqs = [make_request(i, synthetic_prompt(6 + i, seed=i), max_tokens=30) for i in range(8)]
    engine = run(reqs, config(num_kv_blocks=14, max_num_batched_tokens=32))

    assert engine.num_preemptions >= 5
    assert_step_limits_hold(engine)
    assert 0 not in [p for s in engine.steps for p in s.preempted_seq_ids]
    engine.assert_matches_reference()


# ============================================================================ random workloads
@st.composite
def workloads(draw: st.DrawFn) -> tuple:
    bs = draw(st.integers(1, 32))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = np.random.default_rng(seed)
    base = gen.integers(0, 64, size=300).tolist()
    reqs = []
    for i in range(draw(st.integers(2, 10))):
        kind = draw(st.sampled_from(["fresh", "shared prefix", "duplicate"]))
        n = draw(st.integers(1, 300))
        if kind == "duplicate" and reqs:
            prompt = reqs[-1].prompt_token_ids.tolist()
        elif kind == "shared prefix":
            prompt = base[:n]
        else:
            prompt = gen.integers(0, 64, size=n).tolist()
        stops = [draw(st.integers(0, 63))] if draw(st.booleans()) else []
        reqs.append(make_request(i, prompt, draw(st.integers(1, 40)), stops))
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    # Every request fits the whole cache alone (a request that cannot is BR-18's, tested apart);
    # together they usually do not.
    capacity = draw(st.integers(longest, longest + longest // 2))
    cfg = SchedulerConfig(
        num_kv_blocks=-(-capacity // bs),
        block_size=bs,
        max_model_len=max(len(r.prompt_token_ids) for r in reqs) + draw(st.integers(1, 50)),
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.sampled_from([1, 3, 16, 64, 100, 512, 8192])),
        enable_prefix_caching=draw(st.booleans()),
        max_steps_in_flight=draw(st.sampled_from([2, 2, 1, 3])),  # the engine uses 2
    )
    interleaving = draw(st.sampled_from(["lazy", "eager"]) | st.builds(random.Random, st.integers(0, 1000)))
    return cfg, reqs, interleaving


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_produce_the_reference_outputs(workload: tuple) -> None:
    cfg, reqs, interleaving = workload
    engine = run(reqs, cfg, vocab_size=64, interleaving=interleaving)
    event(f"preempted: {engine.num_preemptions > 0}")
    event(f"prefix hit: {any(engine.num_cached_tokens.values())}")
    event(f"chunked: {any(r.kind == 'prefill' for s in engine.steps for r in s.rows)}")
    event(f"stopped: {'stop' in engine.finish_reasons.values()}")

    engine.assert_matches_reference()
    assert_step_limits_hold(engine)


def test_prefix_caching_saves_computation_without_changing_outputs() -> None:
    shared = synthetic_prompt(40, seed=7)
    reqs = [make_request(i, shared + synthetic_prompt(5, seed=100 + i), max_tokens=5) for i in range(6)]
    with_cache = run(reqs, config(num_kv_blocks=128, max_num_batched_tokens=512))
    without = run(reqs, config(num_kv_blocks=128, max_num_batched_tokens=512, enable_prefix_caching=False))

    assert with_cache.outputs == without.outputs
    assert with_cache.num_cached_tokens == {0: 0, **{i: 40 for i in range(1, 6)}}
    assert set(without.num_cached_tokens.values()) == {0}
    computed = lambda e: sum(s.num_scheduled_tokens for s in e.steps)  # noqa: E731
    assert computed(without) - computed(with_cache) == 5 * 40
    with_cache.assert_matches_reference()


def test_follow_up_prompt_hits_the_blocks_holding_the_previous_answer() -> None:
    first = synthetic_prompt(8, seed=8)
    engine = run([make_request(0, first, max_tokens=9)], config())
    # 17 tokens, KV for positions 0..15: 4 full blocks, the last one ending with the 8th output.
    follow_up = first + engine.outputs[0] + synthetic_prompt(3, seed=9)
    engine.add(make_request(1, follow_up, max_tokens=4))
    engine.run_until_done()

    assert engine.num_cached_tokens[1] == 16
    engine.assert_matches_reference()


# ============================================================================ add_request errors
@pytest.mark.parametrize(("prompt_len", "max_tokens", "temperature", "needles"), [
    (0, 4, 0.0, ["empty"]),
    (100, 4, 0.0, ["100 tokens", "max_model_len is 100"]),
    (101, 4, 0.0, ["101 tokens", "max_model_len is 100"]),
    (41, 4, 0.0, ["41 tokens", "needs 11 KV-cache blocks of 4 tokens", "only 10 blocks"]),
    (5, 0, 0.0, ["max_tokens must be >= 1"]),
    (5, 4, -0.5, ["temperature >= 0"]),
])
def test_add_request_rejects_requests_that_can_never_run_and_queues_nothing(
        prompt_len: int, max_tokens: int, temperature: float, needles: list[str]) -> None:
    sched = Scheduler(config(num_kv_blocks=10, max_model_len=100))
    req = make_request(7, synthetic_prompt(prompt_len, seed=1), max_tokens, temperature=temperature)

    (error,) = sched.add_request(req)

    assert error.seq_id == 7 and error.reason == "error"
    for needle in needles:
        assert needle in error.error
    assert not sched.seqs and not sched.waiting and not sched.running
    assert sched.block_manager.num_free_blocks == 10
    assert sched.schedule() is None


def test_add_request_rejects_a_live_duplicate_id_and_out_of_vocabulary_tokens() -> None:
    sched = Scheduler(config(vocab_size=1000))
    assert sched.add_request(make_request(1, [5, 6], 4)) == []
    (dup,) = sched.add_request(make_request(1, [7, 8], 4))
    assert "duplicate sequence id 1" in dup.error
    (oov,) = sched.add_request(make_request(2, [5, 1000], 4))
    assert "[0, 1000)" in oov.error
    assert list(sched.seqs) == [1] and [s.seq_id for s in sched.waiting] == [1]
    assert sched.seqs[1].token_ids == [5, 6]


def test_a_prompt_one_token_shorter_than_max_model_len_gets_exactly_one_token() -> None:
    engine = run([make_request(0, synthetic_prompt(99, seed=3), max_tokens=8)], config(max_model_len=100))
    assert len(engine.outputs[0]) == 1 and engine.finish_reasons[0] == "length"
    engine.assert_matches_reference()


# ============================================================================ abort
def step_until(engine: FakeEngine, condition, limit: int = 1000) -> None:
    for _ in range(limit):
        if condition():
            return
        engine.step()
    raise AssertionError("condition never reached")


def test_abort_of_a_waiting_request_never_reaches_the_workers() -> None:
    engine = FakeEngine(config(max_num_seqs=1))
    engine.add(make_request(0, synthetic_prompt(10, seed=0), 5))
    engine.add(make_request(1, synthetic_prompt(10, seed=1), 5))
    engine.step()
    assert [s.seq_id for s in engine.scheduler.waiting] == [1]

    (fin,) = engine.abort([1])

    assert (fin.seq_id, fin.reason, fin.num_cached_tokens) == (1, "abort", 0)
    engine.run_until_done()
    assert engine.outputs[1] == []
    assert all(1 not in s.plan.finished_seq_ids.tolist() and 1 not in [r.seq_id for r in s.rows] for s in engine.steps)
    assert engine.abort([1]) == []  # already finished: ignored
    assert engine.outputs[0] == engine.reference(0)[0]


def test_abort_of_a_running_request_frees_its_blocks_and_discards_its_token_in_flight() -> None:
    engine = FakeEngine(config())
    engine.add(make_request(0, synthetic_prompt(10, seed=0), 50))
    engine.add(make_request(1, synthetic_prompt(10, seed=1), 50))
    step_until(engine, lambda: len(engine.outputs[0]) >= 3)
    engine.scheduler_iteration()
    in_flight = sum(seq.seq_id == 0 for step in engine.scheduler.in_flight for seq in step.sampling_seqs)
    assert in_flight >= 1
    received = list(engine.outputs[0])
    own_blocks = len(engine.scheduler.seqs[0].block_table)
    free_before = engine.scheduler.block_manager.num_free_blocks

    (fin,) = engine.abort([0])

    assert fin.reason == "abort"
    assert engine.scheduler.block_manager.num_free_blocks == free_before + own_blocks
    engine.run_until_done()
    assert engine.outputs[0] == received  # the tokens in flight were dropped
    sent_finished = [s for s in engine.steps if 0 in s.plan.finished_seq_ids.tolist()]
    assert len(sent_finished) == 1
    assert engine.outputs[1] == engine.reference(1)[0]


def test_abort_of_a_preempted_request_makes_the_workers_forget_it() -> None:
    reqs = [make_request(0, synthetic_prompt(8, seed=0), 12), make_request(1, synthetic_prompt(8, seed=1), 20)]
    engine = FakeEngine(config(num_kv_blocks=9))
    for r in reqs:
        engine.add(r)
    step_until(engine, lambda: engine.scheduler.num_preemptions == 1)
    preempted = engine.scheduler.seqs[1]
    assert preempted in engine.scheduler.waiting and preempted.block_table == []
    assert 1 in engine.worker.batch.reqs  # the workers keep its tokens while it waits

    engine.abort([1])
    engine.run_until_done()  # checks: all blocks free, the workers hold nobody

    assert engine.finish_reasons == {0: "length", 1: "abort"}
    assert engine.outputs[0] == engine.reference(0)[0]
    assert engine.outputs[1] == engine.reference(1)[0][:len(engine.outputs[1])]


def test_stop_token_ends_a_request_whose_next_token_is_already_in_flight() -> None:
    prompt = synthetic_prompt(10, seed=5)
    third = reference_output(prompt, 50, max_model_len=256)[0][2]
    engine = run([make_request(0, prompt, 50, stop_token_ids=[third])], config())

    assert engine.finish_reasons[0] == "stop"
    assert engine.outputs[0] == reference_output(prompt, 50, max_model_len=256)[0][:3]
    samplings = [s.step_id for s in engine.steps if 0 in s.sampling_seq_ids]
    assert len(samplings) == 4  # the fourth sample was computed speculatively and discarded
    engine.assert_matches_reference()


def test_late_token_of_a_finished_request_never_lands_in_its_successors_row() -> None:
    """The row of a request that stopped is taken by the next one while a speculative step of the
    stopped request is still being finalized; that step's token must be dropped, not written there."""
    first = synthetic_prompt(4, seed=12)
    stop = reference_output(first, 50, max_model_len=256)[0][2]
    second = synthetic_prompt(40, seed=13)
    engine = run([make_request(0, first, 50, stop_token_ids=[stop]), make_request(1, second, 3)],
                 config(max_num_seqs=1, max_num_batched_tokens=2))

    handover = next(s for s in engine.steps if 1 in s.admitted_seq_ids)
    assert 0 in handover.plan.finished_seq_ids.tolist()
    (before,) = [s for s in engine.steps if s.step_id == handover.step_id - 1]
    assert before.sampling_seq_ids == [0]  # its token is still in flight at the handover
    assert engine.outputs[1] == reference_output(second, 3, max_model_len=256)[0]
    engine.assert_matches_reference()


# ============================================================================ BR-16
@pytest.mark.parametrize("budget", [8192, 16])
def test_requests_that_finish_at_prefill_release_everything(budget: int) -> None:
    reqs = [make_request(i, synthetic_prompt(6 + (i * 7) % 38, seed=i), max_tokens=1) for i in range(60)]
    engine = run(reqs, config(num_kv_blocks=48, block_size=16, max_model_len=1024, max_num_batched_tokens=budget,
                              max_num_seqs=32))

    engine.assert_matches_reference()
    assert all(len(out) == 1 for out in engine.outputs.values())
    assert sum(len(s.sampling_seq_ids) for s in engine.steps) == 60  # one sampling row per request
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.seqs and not engine.worker.batch.reqs

    engine.add(make_request(100, synthetic_prompt(20, seed=100), max_tokens=32))
    engine.run_until_done()
    assert engine.outputs[100] == engine.reference(100)[0] and len(engine.outputs[100]) == 32


# ============================================================================ the cache's capacity


@pytest.mark.parametrize(("prompt_len", "max_steps_in_flight", "interleaving"), [
    (16, 2, "lazy"),
    (17, 2, "lazy"),
    (16, 2, "eager"),
    (17, 2, "eager"),
    (16, 1, "lazy"),
])
def test_request_stopped_by_the_cache_capacity_is_reported_finished(
        prompt_len: int, max_steps_in_flight: int, interleaving: str) -> None:
    """Alone with 2 blocks of 16 (32 slots), a request stops with "length" at 33 tokens.

    Whether its last token is still in flight when the scheduler finds no block decides which path
    ends it: with a token in flight it ends in `process_result` and is reported; without one (the
    device returned both in-flight results before the scheduler planned again, or one step in
    flight), `Scheduler.schedule` calls `self._finish(seq, "length", [])`: the FinishedSeq goes into
    a throw-away list, so the frontend never hears of it and the client waits forever.
    """
    cfg = config(num_kv_blocks=2, block_size=16, max_steps_in_flight=max_steps_in_flight)
    engine = run([make_request(0, synthetic_prompt(prompt_len, seed=1), max_tokens=100)], cfg,
                 interleaving=interleaving)

    assert engine.finish_reasons == {0: "length"}
    assert len(engine.outputs[0]) == 33 - prompt_len
    engine.assert_matches_reference()


# ============================================================================ plan size
def steady_decode_plan(num_requests: int = 256, block_size: int = 256, prompt_len: int = 100) -> StepPlan:
    """A decode plan of `num_requests` running requests, none of which needs a new block."""
    sched = Scheduler(SchedulerConfig(num_kv_blocks=2 * num_requests, block_size=block_size, max_model_len=4096,
                                      max_num_seqs=num_requests, max_num_batched_tokens=num_requests * prompt_len))
    for i in range(num_requests):
        sched.add_request(make_request(i, synthetic_prompt(prompt_len, seed=i), max_tokens=1000))
    for _ in range(3):
        plan = sched.schedule()
        assert plan is not None
        sched.process_result(StepResult(plan.step_id, i32(np.full(num_requests, 7))))
    plan = sched.schedule()
    assert plan is not None and len(plan.decode_seq_ids) == num_requests
    assert not plan.new_blocks and not plan.new_requests and not plan.finished_seq_ids.size
    return plan


def test_steady_decode_plan_of_256_requests_encodes_in_at_most_2_kib() -> None:
    assert len(encode(steady_decode_plan())) <= 2048


# ============================================================================ the worker loop
class _StubStep:
    def __init__(self, step_id: int, runner: _StubRunner) -> None:
        self.step_id = step_id
        self.timings: dict[str, float] = {}
        self.runner = runner
        self.logprobs = self.prompt_logprobs = None
        self.failed: dict[int, str] = {}
        self.grammar_incomplete: list[int] = []
        # A device step (GPU) has an event: its result overlaps the next step's launch. A CPU step has none: it is
        # done when `execute` returns.
        self.event = object() if runner.on_device else None

    def ready(self) -> bool:
        return self.event is None or self.runner.num_plans >= 2  # the device is busy when the next plan arrives


class _StubRunner:
    on_device = True

    def __init__(self, *args: object, **kwargs: object) -> None:  # ModelRunner(config, rank, ..., report_grammar=)
        self.num_plans = 0
        self.finalized: list[int] = []
        self.calls: list[tuple[str, int]] = []  # ("execute" | "send", step id), in order

    def execute(self, plan: StepPlan) -> _StubStep | None:
        self.num_plans += 1
        self.calls.append(("execute", plan.step_id))
        return _StubStep(plan.step_id, self) if plan.step_id >= 0 else None

    def finalize(self, step: _StubStep) -> np.ndarray:
        self.finalized.append(step.step_id)
        self.calls.append(("send", step.step_id))
        return np.zeros(1, dtype=np.int32)


class _StubCPURunner(_StubRunner):
    on_device = False


class _StubConstrainedRunner(_StubRunner):
    """Every step has constrained rows: `execute` receives the previous step's tokens before it fills the masks, and
    says so as ModelRunner does (`on_previous_received`)."""

    def execute(self, plan: StepPlan) -> _StubStep | None:
        step = super().execute(plan)
        self.on_previous_received()  # type: ignore[attr-defined]  # set by the worker's loop
        self.calls.append(("masks", plan.step_id))
        return step


def _run_worker_loop(monkeypatch: pytest.MonkeyPatch, runner: type[_StubRunner], plans_to_send: list[StepPlan],
                     max_steps_in_flight: int = 2) -> tuple[_StubRunner, list[int]]:
    """Queue `plans_to_send` and a shutdown, run rank 0's step loop over them with a stub `runner`; returns the
    runner and the step ids of the results it sent."""
    import workers.process as worker_process

    monkeypatch.setattr(worker_process, "ModelRunner", runner)
    endpoints = ipc.Endpoints.create(1)
    ctx = zmq.Context.instance()
    plans = ipc.make_socket(ctx, zmq.PUSH, endpoints.plans[0], bind=True)
    results = ipc.make_socket(ctx, zmq.PULL, endpoints.worker_out, bind=True)
    # All the worker reads besides the stub runner.
    config = SimpleNamespace(device="cpu", tensor_parallel_size=1, profile_dir=None,
                             max_steps_in_flight=max_steps_in_flight)
    worker = worker_process.WorkerProcess(config, endpoints, 0)  # type: ignore[arg-type]
    try:
        for plan in plans_to_send:
            ipc.send(plans, plan)
        time.sleep(0.1)
        ipc.send(plans, worker_process.Shutdown("test"))
        worker.serve()
        sent = []
        while results.poll(200):
            sent.append(decode(results.recv()).step_id)
    finally:
        for sock in (worker.control, worker.plans, worker.results, plans, results):
            sock.close()
        endpoints.cleanup()
    return worker.runner, sent


def test_worker_loop_sends_each_step_result_once_when_a_plan_has_no_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan with no rows (only finished ids) after a launched step: that step's result goes out once.

    The scheduler sends such a plan whenever a request stops while another step is in flight.
    """
    runner, sent = _run_worker_loop(monkeypatch, _StubRunner, [StepPlan(step_id=0, decode_seq_ids=i32([3])),
                                                               StepPlan(step_id=-1, finished_seq_ids=i32([4]))])
    assert runner.finalized == [0]
    assert sent == [0]


def test_worker_loop_sends_a_cpu_step_before_the_next_runs_and_a_gpu_step_after_the_next_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU step's result overlaps the next step's launch; a CPU step is computed in full by `execute`, so running
    the next one first would only hold its tokens back a whole step (a fresh user saw CPU tokens come in pairs)."""
    plans = [StepPlan(step_id=i, decode_seq_ids=i32([3])) for i in range(3)]
    runner, sent = _run_worker_loop(monkeypatch, _StubCPURunner, plans)
    assert runner.calls == [("execute", 0), ("send", 0), ("execute", 1), ("send", 1), ("execute", 2), ("send", 2)]
    assert sent == [0, 1, 2]
    runner, sent = _run_worker_loop(monkeypatch, _StubRunner, plans)
    assert runner.calls == [("execute", 0), ("execute", 1), ("send", 0), ("execute", 2), ("send", 1), ("send", 2)]
    assert sent == [0, 1, 2]


def test_worker_loop_with_three_steps_in_flight_keeps_one_older_step_pending_after_a_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`max_steps_in_flight` 3: the scheduler plans step N+2 from step N's result, so after launching N+2 the worker
    sends N (its tokens are due first) and leaves N+1 running; a CPU step still goes out before the next runs."""
    plans = [StepPlan(step_id=i, decode_seq_ids=i32([3])) for i in range(4)]
    runner, sent = _run_worker_loop(monkeypatch, _StubRunner, plans, max_steps_in_flight=3)
    assert runner.calls == [("execute", 0), ("execute", 1), ("execute", 2), ("send", 0), ("execute", 3), ("send", 1),
                            ("send", 2), ("send", 3)]
    assert sent == [0, 1, 2, 3]
    runner, sent = _run_worker_loop(monkeypatch, _StubCPURunner, plans, max_steps_in_flight=3)
    assert runner.calls == [call for i in range(4) for call in (("execute", i), ("send", i))]
    assert sent == [0, 1, 2, 3]


def test_worker_loop_sends_the_previous_result_before_a_constrained_step_fills_its_masks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with constrained rows waits for the previous step's tokens to fill its masks; that step's result goes
    out then, once, so that the scheduler plans the next step while the masks are filled (sent after the launch, it
    left the device idle for the scheduler's round trip after every constrained step)."""
    plans = [StepPlan(step_id=i, decode_seq_ids=i32([3])) for i in range(3)]
    runner, sent = _run_worker_loop(monkeypatch, _StubConstrainedRunner, plans)
    assert runner.calls == [("execute", 0), ("masks", 0), ("execute", 1), ("send", 0), ("masks", 1),
                            ("execute", 2), ("send", 1), ("masks", 2), ("send", 2)]
    assert sent == [0, 1, 2]


def test_a_constrained_request_is_checked_at_its_last_token_and_an_incomplete_grammar_reaches_its_finish() -> None:
    """The plan that samples a constrained request's last token (max_tokens) names it, and only that plan; rank 0's
    answer that its grammar was then incomplete marks its "length" finish (structured outputs, issue 32)."""
    from common.protocol import GrammarCompiled, GrammarSpec

    sched = Scheduler(config())
    finished = []
    for seq_id in (0, 10):  # the same grammar; request 10 ends complete
        req = make_request(seq_id, synthetic_prompt(5, seq_id), max_tokens=2)
        req.grammar = GrammarSpec("regex", "[a-z]+")
        sched.add_request(req)
    work = sched.take_grammar_work()
    sched.grammar_compiled(GrammarCompiled(0, work.grammars[0].grammar_id))
    checked = []
    while sched.num_unfinished:
        plan = sched.schedule()
        checked.append(plan.check_grammar_seq_ids.tolist())
        tokens = [7] * len(sched.in_flight[-1].sampling_seqs)
        incomplete = i32([0] if 0 in checked[-1] else [])
        finished += sched.process_result(StepResult(plan.step_id, i32(tokens),
                                                    grammar_incomplete_seq_ids=incomplete)).finished
    assert checked == [[], [0, 10]]  # the prefill samples token 1 of 2; the decode step samples the last
    assert [(f.seq_id, f.reason, f.structured_output_incomplete) for f in finished] == [(0, "length", True),
                                                                                       (10, "length", False)]


def test_model_runner_reports_the_previous_tokens_and_resumes_its_phase() -> None:
    """`ModelRunner._receive_launched` (the constrained steps' wait) receives up to the step launched last, then calls
    `on_previous_received` (the worker sends those steps' results there), and the open profiling phase goes on."""
    from collections import deque

    from common.profiling import PhaseRecorder
    from workers.model_runner import ModelRunner

    events: list[str] = []
    phases = PhaseRecorder()
    phases.start(lambda name: SimpleNamespace(__enter__=lambda: None, __exit__=lambda *a: None))
    unreceived = deque(["step 3", "step 4"])

    def receive(step: str) -> None:
        events.append(step)
        unreceived.clear()  # ModelRunner.receive receives every older step too

    runner = SimpleNamespace(_unreceived=unreceived, phases=phases, receive=receive)

    def send() -> None:
        events.append("sent")
        phases.begin("send result", 4)
        phases.end()

    runner.on_previous_received = send
    phases.begin("sample", 5)
    ModelRunner._receive_launched(runner)  # type: ignore[arg-type]
    assert events == ["step 4", "sent"]
    assert phases.current == ("sample", 5)
    ModelRunner._receive_launched(runner)  # type: ignore[arg-type]  # nothing left to receive or send
    assert events == ["step 4", "sent"]


def test_model_runner_receives_launched_steps_in_launch_order() -> None:
    """Receiving a step receives every step launched before it first (each step's tokens extend its requests and
    advance their matchers, which must see them in order), and each step once."""
    from collections import deque

    from workers.model_runner import ModelRunner

    steps = [SimpleNamespace(tokens=None, name=f"step {i}") for i in range(3)]
    received: list[str] = []

    def receive_one(step: SimpleNamespace) -> str:
        if step.tokens is None:
            received.append(step.name)
            step.tokens = step.name
        return step.tokens

    runner = SimpleNamespace(_unreceived=deque(steps), _receive_one=receive_one)
    assert ModelRunner.receive(runner, steps[1]) == "step 1"  # type: ignore[arg-type]
    assert received == ["step 0", "step 1"] and list(runner._unreceived) == [steps[2]]
    assert ModelRunner.receive(runner, steps[0]) == "step 0"  # type: ignore[arg-type]
    assert ModelRunner.receive(runner, steps[2]) == "step 2"  # type: ignore[arg-type]
    assert received == ["step 0", "step 1", "step 2"] and not runner._unreceived
