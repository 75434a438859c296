"""The step watchdog's bounds, on a clock of the test's own: relative to the longest step of the same shape
(20x, at least a minute), generous for a step unlike any measured (the first large prefill on CPU runs for
minutes), and never past DELTASERVE_STEP_TIMEOUT_S."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from common import ipc
from common.protocol import AddRequests, NewRequest, StepPlan, i32
from deltaserve import EngineClient, SamplingParams
from frontend.launcher import EngineDeadError
from scheduler_proc.watchdog import StepShape, StepWatchdog
from tests.fake_worker import make_request, synthetic_prompt
from tests.test_scheduler_idle import SchedulerHarness

CPU_UNSEEN_S = 3600.0
DECODE = StepShape(tokens_bucket=1, context_bucket=7)  # one decode row at a context of 64..127 tokens
BIG_PREFILL = StepShape(tokens_bucket=14, context_bucket=14)  # an 8k-token prompt


def _run(dog: StepWatchdog, step_id: int, shape: StepShape, start: float, took: float) -> None:
    dog.sent(step_id, shape, start)
    dog.finished(step_id, start + took)


def test_the_first_large_prefill_on_cpu_may_run_for_most_of_an_hour() -> None:
    dog = StepWatchdog(CPU_UNSEEN_S, floor_s=60.0)
    dog.sent(0, BIG_PREFILL, 0.0)
    assert dog.stuck(1800.0) is None  # 30 minutes in: still a legitimate prefill (one 8k chunk took 203 s)
    stuck = dog.stuck(3601.0)
    assert stuck is not None and stuck.step_id == 0 and stuck.bound_s == CPU_UNSEEN_S and stuck.longest_s is None


def test_a_step_like_measured_ones_is_stuck_after_the_floor_when_those_were_fast() -> None:
    dog = StepWatchdog(CPU_UNSEEN_S, floor_s=60.0)
    for i in range(3):
        _run(dog, i, DECODE, start=i * 1.0, took=0.05)
    dog.sent(3, DECODE, 10.0)
    assert dog.stuck(69.0) is None
    stuck = dog.stuck(71.0)
    assert stuck is not None and stuck.bound_s == 60.0 and stuck.longest_s == pytest.approx(0.05)


def test_the_bound_is_twenty_times_the_longest_step_of_that_shape() -> None:
    dog = StepWatchdog(CPU_UNSEEN_S, floor_s=60.0)
    _run(dog, 0, BIG_PREFILL, start=0.0, took=10.0)
    _run(dog, 1, BIG_PREFILL, start=20.0, took=4.0)  # a faster one does not lower it
    dog.sent(2, BIG_PREFILL, 100.0)
    assert dog.stuck(299.0) is None
    assert dog.stuck(301.0).bound_s == pytest.approx(200.0)


def test_an_unseen_shape_takes_the_bound_of_a_larger_measured_one() -> None:
    """After one big prefill, a stopped worker is noticed within a minute on any smaller step, though that
    exact shape was never measured."""
    dog = StepWatchdog(CPU_UNSEEN_S, floor_s=60.0)
    _run(dog, 0, BIG_PREFILL, start=0.0, took=2.0)
    assert dog.bound_s(DECODE) == (60.0, 2.0)
    assert dog.bound_s(StepShape(1, 15)) == (CPU_UNSEEN_S, None)  # not comparable with the measured shape


def test_a_step_larger_than_any_measured_is_bounded_by_its_work_times_the_time_of_a_smaller_one() -> None:
    """A new prompt arriving among running decodes (a fresh user's trial: a stopped worker went unnoticed for an
    hour on CPU): its bound grows with 2 per token bucket and per context bucket above a measured shape, 20
    times that, so minutes rather than DELTASERVE_STEP_TIMEOUT_S; a step far larger still gets the cap."""
    dog = StepWatchdog(CPU_UNSEEN_S, floor_s=60.0)
    four_decodes = StepShape(3, 11)  # 4 rows at about 400 tokens of context each
    for i in range(3):
        _run(dog, i, four_decodes, start=i * 1.0, took=0.03)
    with_prompt = StepShape(9, 12)  # a 400-token prompt beside them: 2 ** (6 + 1) times the work at most
    assert dog.bound_s(with_prompt) == (pytest.approx(20 * 0.03 * 128), pytest.approx(0.03))
    dog.sent(3, with_prompt, 10.0)
    assert dog.stuck(10.0 + 76.0) is None
    stuck = dog.stuck(10.0 + 78.0)
    assert stuck is not None and stuck.work_ratio == 128 and stuck.bound_s == pytest.approx(76.8)
    # the smallest extrapolation wins: a measured step of another, nearer shape bounds it more tightly
    _run(dog, 4, StepShape(8, 12), start=100.0, took=0.5)
    assert dog.bound_s(with_prompt) == (60.0, 0.5)  # 20 * 0.5 s * 2 = 20 s, raised to the floor
    # an 8k-token prompt: 2 ** (6 + 2) times 0.5 s, 20 times (from the decodes it would be past the cap)
    assert dog.bound_s(BIG_PREFILL) == (2560.0, 0.5)
    assert dog.bound_s(StepShape(20, 20))[0] == CPU_UNSEEN_S  # past the cap from every measured shape: the cap


def test_no_bound_exceeds_the_step_timeout_variable() -> None:
    dog = StepWatchdog(unseen_s=2.0, floor_s=60.0)
    _run(dog, 0, DECODE, start=0.0, took=0.01)
    assert dog.bound_s(DECODE) == (2.0, 0.01)


def test_a_pipelined_step_is_timed_from_when_the_step_before_it_finished() -> None:
    """Its plan goes out while the previous step runs; the workers start it only when that one finishes."""
    dog = StepWatchdog(CPU_UNSEEN_S, floor_s=60.0)
    _run(dog, 0, DECODE, start=0.0, took=0.1)
    dog.sent(1, BIG_PREFILL, 1.0)
    dog.sent(2, DECODE, 1.0)  # planned while step 1 runs
    dog.finished(1, 500.0)  # a long first prefill
    assert dog.longest[BIG_PREFILL] == pytest.approx(499.0)
    assert dog.stuck(559.0) is None  # step 2 started at 500 s, not at 1 s
    assert dog.stuck(561.0).step_id == 2
    dog.finished(2, 561.5)
    assert dog.longest[DECODE] == pytest.approx(61.5)  # from 500 s, when it could start


def test_zero_turns_the_watchdog_off() -> None:
    dog = StepWatchdog(unseen_s=0.0, floor_s=60.0)
    dog.sent(0, DECODE, 0.0)
    assert dog.stuck(10**9) is None


def test_the_step_after_a_profiling_session_may_wait_for_the_trace_but_only_that_one() -> None:
    """The workers write their traces once the session's last step is done: the next step to finish is bounded by
    DELTASERVE_STEP_TIMEOUT_S alone, and its time is not learned (the steps after it are bounded as before)."""
    dog = StepWatchdog(CPU_UNSEEN_S, floor_s=60.0)
    for i in range(3):
        _run(dog, i, DECODE, start=i * 1.0, took=0.05)
    dog.excuse_after(2)
    dog.sent(3, DECODE, 10.0)
    assert dog.stuck(600.0) is None  # ten minutes of trace writing (a 256-row CPU session took over one)
    stuck = dog.stuck(3611.0)
    assert stuck is not None and stuck.after_profiling and stuck.bound_s == CPU_UNSEEN_S
    dog.finished(3, 700.0)
    assert dog.bound_s(DECODE) == (60.0, pytest.approx(0.05))  # 690 s were the trace's, not the step's
    dog.sent(4, DECODE, 700.0)
    assert dog.stuck(761.0).bound_s == 60.0 and not dog.stuck(761.0).after_profiling


def test_a_worker_writing_its_trace_is_not_taken_for_a_stuck_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The real scheduler loop, with the test as its worker: the profile window is steps 0..1; the worker sits on
    step 2 for four times the floor (as while it writes its trace) and the engine serves on; it sits on step 4
    as long, and that is a stuck worker."""
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_S", "30")
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_FLOOR_S", "0.4")
    h = SchedulerHarness(tmp_path, 64, profile_dir=str(tmp_path / "profile"), profile_steps="0:2")
    try:
        ipc.send(h.to_scheduler, AddRequests([make_request(0, synthetic_prompt(20, 0), max_tokens=50)]))
        plans = [h.recv_plan(), h.recv_plan()]  # two steps in flight: the prefill and the first decode
        for step in range(4):
            if step == 2:
                time.sleep(1.6)
            h.answer(plans[step])
            plans.append(h.recv_plan())  # each result lets one more step go out
        assert h.error is None and [p.step_id for p in plans] == [0, 1, 2, 3, 4, 5]
        time.sleep(1.6)  # on step 4, a step like the measured ones
        h.thread.join(5)
        assert re.search(r"step 4 has not finished after \d+ s \(its bound is [\d.]+ s: 20 times the longest step like",
                         str(h.error)), h.error
        h.error = None
    finally:
        h.close()
    assert Path(tmp_path / "profile" / "scheduler.phases.json").is_file()


def test_a_steps_shape_buckets_its_tokens_and_the_context_its_rows_attend_to() -> None:
    plan = StepPlan(step_id=0, new_requests=[NewRequest(7, i32(range(100)), 0.0, None, i32([0]), 32, 68)],
                    prefill_seq_ids=i32([3]), prefill_num_tokens=i32([50]), decode_seq_ids=i32([4, 5]))
    context = {3: 550, 4: 90, 5: 1000}  # computed tokens after this step
    shape = StepShape.of(plan, context.__getitem__)
    assert shape == StepShape((68 + 50 + 2).bit_length(), (100 + 550 + 90 + 1000).bit_length())


def test_a_stopped_worker_is_reported_within_the_floor_not_after_an_hour(tiny_qwen3: Path, engine_factory,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU without DELTASERVE_STEP_TIMEOUT_S (an hour for unseen steps): decode steps like the ones
    already measured are bounded by the floor (2 s here, a minute by default)."""
    monkeypatch.delenv("DELTASERVE_STEP_TIMEOUT_S", raising=False)
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_FLOOR_S", "2")
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=256)
    assert llm.info["step_timeout_s"] == CPU_UNSEEN_S and llm.info["step_timeout_floor_s"] == 2.0
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.generate([[1000, 1001, 1002]], warm, use_tqdm=False)[0]["token_ids"]  # torch's first calls are slow
    client = EngineClient(llm.engine.endpoints.client, dead_after_s=30)
    prompt = list(range(1000, 1070))  # 70 tokens: its prefill covers every decode up to a context of 127
    outputs = client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    try:
        for _ in range(5):  # a few decode steps measured
            next(outputs)
        os.kill(llm.engine.procs["worker-tp0"].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"has not finished after \d+ s \(its bound is \d+ s: 20 times the "
                                                  r"longest step like it so far") as err:
            llm.engine.wait()
    finally:
        outputs.close()
        client.close()
    assert time.monotonic() - t0 < 15  # the floor, or 20 decode steps of a loaded machine
    assert str(err.value).startswith("worker-tp0 (pid ")  # named as stopped
