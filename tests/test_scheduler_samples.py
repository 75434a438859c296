"""n > 1 in the scheduler, with the content-hash worker of tests/fake_worker.py: the prompt is computed
once, the samples fork from it sharing its full blocks and copying the partial one, each sample is a
sequence of its own afterwards, and everything is released at the end. Also min_tokens, prompt
logprobs and logprobs relaying."""

from __future__ import annotations

import numpy as np
import pytest

from common.protocol import EngineRequest, Logprobs, SamplingOptions, StepResult, f32, i32
from scheduler_proc.scheduler import Scheduler, SchedulerConfig
from tests.fake_worker import FakeEngine, make_request, run, synthetic_prompt


def config(**overrides: object) -> SchedulerConfig:
    base = dict(num_kv_blocks=64, block_size=8, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)
    base.update(overrides)
    return SchedulerConfig(**base)


def first_fork_step(engine: FakeEngine):
    return next(s for s in engine.steps if s.plan.forked_requests)


@pytest.mark.parametrize("prompt_len", [21, 24])  # a partial last block, and none
def test_four_samples_compute_the_prompt_once_and_share_its_full_blocks(prompt_len: int) -> None:
    engine = FakeEngine(config())
    engine.add(make_request(10, synthetic_prompt(prompt_len, seed=1), max_tokens=6, n=4))
    sched, bm = engine.scheduler, engine.scheduler.block_manager
    plan = sched.schedule()  # the whole prompt in one step: the samples fork in it
    full, rest = divmod(prompt_len, 8)
    partial = int(rest > 0)
    assert [r.seq_id for r in plan.new_requests] == [10] and plan.new_requests[0].num_scheduled_tokens == prompt_len
    assert [f.seq_id for f in plan.forked_requests] == [11, 12, 13]
    assert [f.parent_seq_id for f in plan.forked_requests] == [10, 10, 10]
    assert sched.in_flight[-1].sampling_seqs == [sched.seqs[i] for i in (10, 11, 12, 13)]
    parent = sched.seqs[10].block_table
    for fork in plan.forked_requests:
        table = fork.block_ids.tolist()
        assert table[:full] == parent[:full]  # shared
        assert len(table) == full + partial and (not partial or table[-1] not in parent)  # a copy of its own
    assert all(bm.blocks[b].ref_count == 4 for b in parent[:full])
    assert bm.num_blocks - bm.num_free_blocks == full + 4 * partial  # the prompt's blocks, allocated once
    sched.check_invariants()
    # The same run through the fake worker: each sample continues from the right KV (the copy included).
    engine = run([make_request(10, synthetic_prompt(prompt_len, seed=1), max_tokens=6, n=4)], config())
    engine.assert_matches_reference()
    assert sum(r.num_tokens for s in engine.steps for r in s.rows if r.kind == "new") == prompt_len
    assert {engine.finished[s].reason for s in range(10, 14)} == {"length"}
    assert all(len(engine.outputs[s]) == 6 for s in range(10, 14))


def test_samples_sample_after_every_row_from_their_parent_logits() -> None:
    engine = run([make_request(0, synthetic_prompt(5, seed=2), 4),
                  make_request(1, synthetic_prompt(13, seed=3), 4, n=3),
                  make_request(4, synthetic_prompt(9, seed=4), 4)], config())
    step = first_fork_step(engine)
    assert step.sampling_seq_ids[-2:] == [2, 3]
    engine.assert_matches_reference()


def test_samples_that_do_not_fit_wait_and_reuse_the_cached_prompt_blocks() -> None:
    """max_num_seqs 2 lets only one fork run with its parent: the others wait as new requests, take the full
    prompt blocks from the prefix cache and compute only the partial block's tokens."""
    engine = run([make_request(0, synthetic_prompt(20, seed=5), max_tokens=5, n=4)], config(max_num_seqs=2))
    engine.assert_matches_reference()
    assert len(engine.finished) == 4
    assert engine.num_cached_tokens[2] == engine.num_cached_tokens[3] == 16  # two full blocks of 8


def test_samples_fork_even_when_the_cache_is_nearly_full_and_survive_preemption() -> None:
    reqs = [make_request(10 * i, synthetic_prompt(30 + i, seed=i), max_tokens=40, n=3) for i in range(4)]
    engine = run(reqs, config(num_kv_blocks=30, max_num_batched_tokens=32))
    engine.assert_matches_reference()
    assert engine.num_preemptions > 0


def test_aborting_a_request_before_its_samples_forked_finishes_every_sample() -> None:
    sched = Scheduler(config())
    assert sched.add_request(make_request(20, synthetic_prompt(9, seed=6), 4, n=3)) == []
    finished = sched.abort([20, 21, 22])
    assert sorted((f.seq_id, f.reason) for f in finished) == [(20, "abort"), (21, "abort"), (22, "abort")]
    assert not sched.seqs and not sched.waiting


def test_a_request_that_can_never_run_reports_an_error_for_each_sample() -> None:
    sched = Scheduler(config(max_model_len=10))
    errors = sched.add_request(make_request(5, synthetic_prompt(12, seed=7), 4, n=2))
    assert [(e.seq_id, e.reason) for e in errors] == [(5, "error"), (6, "error")]
    assert sched.add_request(make_request(5, [1], 4, n=0))[0].error == "n must be >= 1, got 0"


def test_a_stop_token_ends_a_request_only_after_min_tokens() -> None:
    sched = Scheduler(config())
    req = make_request(0, [1, 2, 3], max_tokens=10, stop_token_ids=[77])
    req.options = SamplingOptions(min_tokens=2, stop_token_ids=[77])
    sched.add_request(req)
    for token, finished in [(77, False), (77, False), (77, True)]:
        plan = sched.schedule()
        out = sched.process_result(StepResult(plan.step_id, i32([token])))
        assert bool(out.finished) is finished
    assert out.finished[0].reason == "stop"


def test_requests_with_prompt_logprobs_never_take_cached_blocks() -> None:
    prompt = synthetic_prompt(24, seed=8)
    first = make_request(0, prompt, 2)
    with_logprobs = make_request(1, prompt, 2)
    with_logprobs.options = SamplingOptions(prompt_logprobs=1)
    engine = run([first], config())
    engine.add(with_logprobs)
    engine.add(make_request(2, prompt, 2))
    engine.run_until_done()
    assert engine.num_cached_tokens == {0: 0, 1: 0, 2: 16}


def test_logprobs_of_tokens_dropped_by_the_scheduler_are_dropped_with_them() -> None:
    """Row 1 finished in an earlier step (its token here is speculative): its logprobs leave with it, and
    the remaining rows are renumbered as indices into the step's outputs."""
    sched = Scheduler(config())
    for i in range(3):
        sched.add_request(make_request(i, [5 + i, 6], max_tokens=1 if i == 1 else 5))
    plan = sched.schedule()
    sched.process_result(StepResult(plan.step_id, i32([1, 2, 3])))
    plan2 = sched.schedule()
    assert plan2.decode_seq_ids.tolist() == [0, 2]
    lp = Logprobs(i32([0, 1]), i32([1, 1]), i32([2, 1]), f32([-0.5, -1.5]), i32([1, 3]), i32([4, 5, 6]),
                  f32([-0.5, -1.0, -0.25]))
    out = sched.process_result(StepResult(plan2.step_id, i32([7, 8]), {}, lp))
    assert out.seq_ids.tolist() == [0, 2]
    assert out.logprobs.rows.tolist() == [0, 1] and out.logprobs.top_token_ids.tolist() == [4, 5, 6]
    # A late row: build the situation by hand (seq 2 finished, its token computed speculatively).
    sched2 = Scheduler(config())
    sched2.add_request(EngineRequest(0, i32([1, 2]), 0.0, 1, None, [], 0.0))
    sched2.add_request(EngineRequest(1, i32([3, 4]), 0.0, 5, None, [], 0.0))
    plan = sched2.schedule()
    plan_b = sched2.schedule()  # step 2 is planned before step 1's result: seq 0's row there is speculative
    sched2.process_result(StepResult(plan.step_id, i32([9, 9])))
    out = sched2.process_result(StepResult(plan_b.step_id, i32([8]), {}, Logprobs(
        i32([0]), i32([1]), i32([1]), f32([-0.1]), i32([1]), i32([3]), f32([-0.1]))))
    assert plan_b.decode_seq_ids.tolist() == [1]
    assert out.logprobs is not None and out.logprobs.rows.tolist() == [0]
    assert np.isclose(out.logprobs.token_logprobs[0], -0.1)
