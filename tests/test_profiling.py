"""Profiling runs: a trace per process, every process on one timeline, sessions started and stopped at the
same step, a summary whose figures add up, and clock alignment of torch.profiler's events."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from common import profiling, timeline
from common.config import ConfigError, EngineConfig, parse_profile_steps
from common.ipc import free_port
from common.profiling import (
    FrontendProfiling,
    ProcessProfiler,
    SchedulerProfiling,
    WorkerProfiling,
    session_folder,
)
from common.protocol import ProfileStart, ProfileStatus, ProfileStop, StartProfile, StopProfile
from frontend.client_cli import main as client_main
from tests.conftest import REPO, wait_until_serving
from tests.test_config import write_checkpoint

PROCESSES = ("frontend", "scheduler", "worker-tp0")


# ============================================================================ settings
@pytest.mark.parametrize(("text", "window"), [("100:140", (100, 140)), ("0:1", (0, 1)), ("none", None),
                                               (" 2 : 8 ", (2, 8))])
def test_profile_steps_is_a_window_of_steps_a_to_b_minus_one_or_none(text: str, window: tuple | None) -> None:
    assert parse_profile_steps(text) == window


@pytest.mark.parametrize("text", ["5:5", "8:2", "-1:4", "10", "a:b", ":9", "3:", ""])
def test_a_bad_profile_steps_is_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(ConfigError, match="profile_steps must be 'A:B' with 0 <= A < B"):
        parse_profile_steps(text)


@pytest.mark.parametrize("text", [f"0:{2**31}", f"{2**62}:{2**62 + 1}", "0:99999999999999999999"])
def test_a_profile_steps_window_stays_bounded_and_inside_int64(text: str) -> None:
    with pytest.raises(ConfigError, match="profile_steps may trace at most 2147483647 steps"):
        parse_profile_steps(text)


def test_an_empty_profile_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="profile_dir must name a folder, got ''"):
        EngineConfig(write_checkpoint(tmp_path / "m"), profile_dir="")


def test_profile_steps_without_a_profile_dir_is_refused(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"profile_steps needs a profile_dir \(--profile-dir\)"):
        EngineConfig(model, profile_steps="3:9")
    config = EngineConfig(model, profile_dir="relative/profile", profile_steps=(3, 9))
    assert config.profile_steps == "3:9"
    assert config.profile_dir == os.path.abspath("relative/profile")  # the processes run in another folder


# ============================================================================ sessions, process by process
class Sent:
    """What a profiling object sent, per destination."""

    def __init__(self) -> None:
        self.workers: list[Any] = []
        self.frontend: list[Any] = []
        self.replies: list[tuple[bytes, Any]] = []


@pytest.fixture
def profiled_config(tmp_path: Path) -> EngineConfig:
    return EngineConfig(write_checkpoint(tmp_path / "m"), profile_dir=str(tmp_path / "profile"),
                        profile_steps="2:5")


def test_the_scheduler_starts_the_window_at_its_first_step_and_stops_it_after_the_last_result(
        profiled_config: EngineConfig) -> None:
    sent = Sent()
    prof = SchedulerProfiling(profiled_config, "run", sent.workers.append, sent.frontend.append)
    prof.before_step(2, has_requests=False)  # an idle engine does not start the window
    prof.before_step(0, has_requests=True)
    assert sent.workers == []
    prof.before_step(2, has_requests=True)
    start = ProfileStart(1, 2, 4, profiled_config.profile_dir)
    assert sent.workers == [start] and sent.frontend == [start]
    for step in (2, 3):
        prof.after_plan(step)
    assert sent.workers == [start]
    prof.after_plan(4)  # the last step's plan is out: the workers stop once they have finished it
    assert sent.workers == [start, ProfileStop(1, 4)]
    prof.after_result(3)
    assert sent.frontend == [start]
    prof.after_result(4)  # its outputs went to the frontend first
    assert sent.frontend == [start, ProfileStop(1, 4)]
    assert json.loads(Path(profiled_config.profile_dir, "scheduler.phases.json").read_text())["last_step"] == 4
    prof.before_step(5, has_requests=True)  # the window runs once
    assert len(sent.workers) == 2
    prof.request(StopProfile(), next_step_id=6, steps_in_flight=False)  # too late: it ended by itself
    summary = Path(profiled_config.profile_dir, "summary.txt")
    assert sent.frontend[-1].error == f"not profiling (1 session so far; the last session's summary is in {summary})"


def test_a_client_session_runs_from_the_next_step_and_stops_after_the_last_one_planned(
        profiled_config: EngineConfig) -> None:
    sent = Sent()
    prof = SchedulerProfiling(profiled_config, "run", sent.workers.append, sent.frontend.append)
    prof.request(StopProfile(), next_step_id=7, steps_in_flight=False)
    assert sent.frontend[-1].error == "not profiling (0 sessions so far)"
    prof.request(StartProfile(num_steps=-1), next_step_id=7, steps_in_flight=False)
    assert sent.frontend[-1].error == "num_steps must be in [0, 2147483647] (0: 3 steps), got -1"
    prof.request(StartProfile(num_steps=2**64 - 1), next_step_id=7, steps_in_flight=False)  # its last step: > 2**64
    assert sent.frontend[-1].error.endswith(f"got {2**64 - 1}") and sent.workers == []
    prof.request(StartProfile(num_steps=0), next_step_id=7, steps_in_flight=False)  # 0: the window's length
    start = ProfileStart(1, 7, 9, profiled_config.profile_dir)
    assert sent.workers == [start]
    assert sent.frontend[-2:] == [start, ProfileStatus(1, 7, 9, profiled_config.profile_dir)]
    prof.request(StartProfile(), next_step_id=8, steps_in_flight=True)
    assert sent.frontend[-1].error == "already profiling (session 1, from step 7): stop it first"
    prof.after_plan(7)
    prof.request(StopProfile(), next_step_id=8, steps_in_flight=True)  # step 7 is still running
    assert sent.workers[-1] == ProfileStop(1, 7)
    assert sent.frontend[-1] == ProfileStatus(1, 7, 7, profiled_config.profile_dir)
    prof.after_result(7)
    assert sent.frontend[-1] == ProfileStop(1, 7)
    prof.request(StartProfile(num_steps=1), next_step_id=8, steps_in_flight=False)
    assert sent.workers[-1] == ProfileStart(2, 8, 8, session_folder(profiled_config.profile_dir, 2))
    prof.request(StopProfile(), next_step_id=8, steps_in_flight=False)  # before any step: it ends at once
    assert sent.workers[-1] == ProfileStop(2, 7) and sent.frontend[-1] == ProfileStop(2, 7)
    assert Path(profiled_config.profile_dir, "session-2", "scheduler.phases.json").is_file()


def test_a_worker_stops_only_once_the_last_step_is_finished(profiled_config: EngineConfig) -> None:
    prof = WorkerProfiling(profiled_config, "run", 0, "cpu")
    folder = profiled_config.profile_dir
    prof.control(ProfileStart(1, 2, 4, folder), pending_step_id=1)
    prof.step_done(1, {"prepare_ms": 1.0})
    prof.control(ProfileStop(1, 2), pending_step_id=2)  # step 2 is launched, its tokens are not back yet
    assert prof.profiler.recording
    prof.step_done(2, {"prepare_ms": 2.0})
    assert not prof.profiler.recording
    record = json.loads(Path(folder, "worker-tp0.phases.json").read_text())
    assert (record["first_step"], record["last_step"], record["complete"]) == (2, 2, True)
    assert record["steps"] == {"1": {"prepare_ms": 1.0}, "2": {"prepare_ms": 2.0}}
    prof.control(ProfileStart(2, 5, 9, folder), pending_step_id=None)
    prof.control(ProfileStop(2, 4), pending_step_id=None)  # nothing launched since: stops at once
    assert not prof.profiler.recording


def test_a_worker_keeps_no_phase_of_a_step_launched_past_the_sessions_last(profiled_config: EngineConfig) -> None:
    prof = WorkerProfiling(profiled_config, "run", 0, "cpu")
    prof.control(ProfileStart(1, 2, 3, profiled_config.profile_dir), pending_step_id=1)
    for step in (2, 3):
        prof.phases.begin("forward", step)
    prof.control(ProfileStop(1, 3), pending_step_id=3)  # step 3 is launched, its tokens are not back yet
    prof.phases.begin("forward", 4)  # the next plan is launched before step 3 is finished
    prof.phases.begin("wait", 3)
    prof.step_done(3, {})
    record = json.loads(Path(profiled_config.profile_dir, "worker-tp0.phases.json").read_text())
    assert [(name, step) for name, step, _, _ in record["phases"]] == [("forward", 2), ("forward", 3), ("wait", 3)]


def test_a_frontend_without_profile_dir_refuses_at_once(tmp_path: Path) -> None:
    sent = Sent()
    prof = FrontendProfiling(EngineConfig(write_checkpoint(tmp_path / "m")), "run",
                             lambda client, msg: sent.replies.append((client, msg)), sent.frontend.append)
    prof.request(b"client", StartProfile())
    assert sent.replies == [(b"client", ProfileStatus(error="profiling is off: start the engine with "
                                                            "--profile-dir DIR"))]
    assert sent.frontend == []  # the scheduler is not bothered
    assert not prof.profiler.enabled and not prof.phases.recording


def test_starting_and_stopping_a_trace_writes_none_of_kinetos_usdt_markers(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """torch's kineto wrote "USDT: ... profiler_start" and "... profiler_stop" on the stderr of every profiled
    process, at each start and stop (the warm-up at construction included); its other lines still come through."""
    capfd.readouterr()
    prof = ProcessProfiler("scheduler", str(tmp_path), "run", "cpu")
    prof.start(ProfileStart(1, 0, 4, str(tmp_path)))
    torch.ones(4).sum()
    prof.stop()
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err, err
    with profiling.kineto_markers_dropped():
        os.write(2, b"USDT:2026-12-04 12:00:00 1:1 File.cpp:1] profiler_start\nsomething else\n")
    assert capfd.readouterr().err == "something else\n"


# ============================================================================ the clock
def test_torch_profiler_events_are_put_on_the_monotonic_clock_by_the_phases_they_share(tmp_path: Path) -> None:
    """torch.profiler stamps events in Unix time (after `baseTimeNanoseconds`); our phases are on
    time.perf_counter. The measured offset agrees with the Unix-clock conversion, and after alignment every
    phase's torch range starts where we stamped it and the ops it ran lie inside it."""
    prof = ProcessProfiler("worker-tp0", str(tmp_path), "run", "cpu")
    prof.start(ProfileStart(1, 0, 4, str(tmp_path)))
    a = torch.randn(128, 128)
    for step in range(5):
        prof.phases.begin("forward", step)
        for _ in range(3):
            a = torch.tanh(a @ a)
        prof.phases.begin("sample", step)
        a.argmax()
        time.sleep(0.01)  # a step of ~10 ms: a range matched to the wrong step would miss by that much
        prof.phases.end()
    prof.stop()
    record = json.loads((tmp_path / "worker-tp0.phases.json").read_text())
    trace = timeline.load_trace(str(tmp_path), record)
    assert trace is not None and trace["baseTimeNanoseconds"] > 1.6e18  # Unix time, floored to ~3 months
    clock = timeline.align(record, trace)
    assert (clock.method, clock.matched) == ("phases", 10)
    assert abs(clock.offset_us - clock.unix_offset_us) < 1000.0  # microseconds
    ours = {(name, step): (start / 1e3, end / 1e3) for name, step, start, end in record["phases"]}
    ranges = [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert len(ranges) == 10
    misses = []
    for e in ranges:
        name, step = timeline._step_label(e["name"])
        misses.append(abs(e["ts"] - clock.offset_us - ours[name, step][0]))
    # A busy host (CI runs two test workers beside engine processes on two cores) can delay any stamp by a few
    # hundred microseconds, so the timing bound is on the median; every range must still land on its own step.
    assert sorted(misses)[4] < 100.0  # microseconds, for at least half of the ranges
    assert max(misses) < 5000.0  # microseconds: half a step
    forward = sorted(ours[k] for k in ours if k[0] == "forward")
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    assert len(ops) == 15
    inside = [any(a0 - 100 <= e["ts"] - clock.offset_us and e["ts"] - clock.offset_us + e["dur"] <= a1 + 100
                  for a0, a1 in forward) for e in ops]
    assert sum(inside) >= 12  # of 15, each within 100 us of its forward phase


# ============================================================================ the device summary
def test_device_gaps_between_steps_come_from_the_work_each_step_launched() -> None:
    """Synthetic Kineto events: the launch calls of each step lie in its phases; their kernels and copies (by
    correlation id) give each step's device span; gaps are between consecutive spans."""
    ms = 1000.0  # microseconds
    phases, launches, work, steps = [], [], [], {}
    for step in range(4):
        t = step * 10 * ms
        phases.append(("graph replay", step, int(t * 1e3), int((t + 1 * ms) * 1e3)))
        for k, (start, dur) in enumerate([(0.5, 2.0), (2.5, 4.0 + step)]):  # a copy, then the graph's kernels
            corr = 100 * step + k
            launches.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t + 0.2 * ms + k,
                             "dur": 5.0, "pid": 1, "tid": 1, "args": {"correlation": corr}})
            work.append({"ph": "X", "cat": "gpu_memcpy" if k == 0 else "kernel", "name": "k", "pid": 0, "tid": 7,
                         "ts": t + start * ms, "dur": dur * ms, "args": {"correlation": corr, "stream": 7}})
        steps[str(step)] = {"idle_ms": 0.9 * (3 - step + 2)}
    record = {"device": "cuda:0", "start_ns": 0, "stop_ns": int(40 * ms * 1e3), "phases": phases, "steps": steps}
    trace = {"traceEvents": launches + work}
    summary = timeline.device_summary(record, trace, timeline.Alignment(0.0, "phases", 4, 0.0, 0.0))
    # Step s spans [10s + 0.5, 10s + 6.5 + s] ms: gaps 10 - 6 - s = 4, 3, 2 ms.
    assert summary["gaps"] == 3 and summary["steps_with_device_work"] == 4
    assert summary["gap_total_ms"] == pytest.approx(9.0)
    assert [g["before_step"] for g in summary["largest_gaps"]] == [1, 2, 3]
    assert summary["largest_gaps"][0]["ms"] == pytest.approx(4.0)
    assert summary["busy_s"] == pytest.approx((6 + 7 + 8 + 9) / 1e3)
    assert summary["busy_share"] == pytest.approx(30 / 40)
    assert summary["step_log_gap_total_ms"] == pytest.approx(0.9 * (4 + 3 + 2))


def test_a_session_cut_short_by_the_shutdown_is_merged_when_the_run_ends(tmp_path: Path) -> None:
    folder = str(tmp_path)
    profilers = [ProcessProfiler(name, folder, "run-a", "cpu") for name in PROCESSES]
    for prof in profilers:
        prof.start(ProfileStart(1, 0, 99, folder))
        for step in range(3):
            prof.phases.begin("work", step)
            time.sleep(0.001)
        prof.phases.end()
        prof.close()  # SIGTERM: the process writes what it has
    tables = timeline.finish_run(folder, "run-a")
    assert len(tables) == 1 and "steps 0..2 (cut short by the shutdown)" in tables[0]
    assert timeline.finish_run(folder, "run-a") == []  # merged once
    assert timeline.finish_run(folder, "run-b") == []  # another run's files are not this run's
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(summary["processes"]) == sorted(PROCESSES)


# ============================================================================ whole engines
def read_timeline(folder: Path) -> tuple[list[dict], dict[int, str]]:
    with gzip.open(folder / "timeline.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    return events, names


def phase_events(events: list[dict], names: dict[int, str], process: str) -> list[dict]:
    return [e for e in events if e.get("cat") == "user_annotation" and names.get(e["pid"]) == process]


@pytest.mark.slow
def test_a_profiled_one_shot_run_writes_every_file_and_one_timeline_of_its_steps(
        tiny_qwen3: Path, tmp_path: Path) -> None:
    folder = tmp_path / "profile"
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--device", "cpu",
                             "--prompt", "Hello there", "--prompt", "Hi", "--max-tokens", "12", "--ignore-eos",
                             "--json", "--profile-dir", str(folder), "--profile-steps", "2:8"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["finish_reason"] for line in result.stdout.splitlines()] == ["length", "length"]
    assert "deltaserve profile, session 1: steps 2..7 in" in result.stderr  # the summary, beside the logs
    assert "USDT" not in result.stderr, result.stderr  # no process's kineto markers
    for name in PROCESSES:
        with gzip.open(folder / f"{name}.pt.trace.json.gz", "rt") as f:
            assert json.load(f)["traceEvents"]
        assert json.loads((folder / f"{name}.phases.json").read_text())["complete"]
        assert len(list(folder.glob(f"{name}-*.prof"))) == 1  # cProfile, as before
    assert (folder / "summary.txt").read_text().startswith("deltaserve profile, session 1: steps 2..7")

    events, names = read_timeline(folder)
    assert sorted(names.values()) == sorted(PROCESSES)

    def start_of(process: str, phase: str, step: int) -> float:
        (e,) = [e for e in phase_events(events, names, process) if e["name"] == phase and e["args"]["step"] == step]
        return e["ts"]

    step = 4
    path = [start_of("scheduler", "send", step), start_of("worker-tp0", "apply plan", step),
            start_of("worker-tp0", "forward", step), start_of("worker-tp0", "send result", step),
            start_of("scheduler", "process result", step), start_of("frontend", "detokenize", step)]
    assert path == sorted(path), path  # the plan leaves, runs, and its tokens reach the frontend, in that order
    flow = [e for e in events if e.get("cat") == "step" and e["name"] == f"step {step}"]
    assert [e["ph"] for e in flow] == ["s", "t", "t", "t", "f"]
    assert [names[e["pid"]] for e in flow] == ["scheduler", "worker-tp0", "worker-tp0", "scheduler", "frontend"]

    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["first_step"], summary["last_step"]) == (2, 7)
    for name, p in summary["processes"].items():
        assert p["busy_s"] + p["idle_s"] == pytest.approx(p["wall_s"], rel=0.01)
        assert p["steps"] == 6
        in_trace = Counter(e["name"] for e in phase_events(events, names, name))
        assert in_trace == {phase: s["count"] for phase, s in p["phases"].items()}  # the table counts what is drawn
    worker = summary["processes"]["worker-tp0"]
    assert worker["phases"]["forward"]["count"] == 6
    assert worker["device_activity"] == {"device": "cpu", "activity": False}


@pytest.mark.slow
def test_a_server_is_profiled_from_the_client_command_line(tiny_qwen3: Path, tmp_path: Path) -> None:
    folder = tmp_path / "profile"
    port = free_port()
    server = subprocess.Popen([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--serve", "--port", str(port),
                               "--device", "cpu", "--max-model-len", "256", "--profile-dir", str(folder),
                               "--profile-steps", "none"], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)

    def client(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "frontend.client", "--port", str(port), *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    try:
        wait_until_serving(server, drain=True)
        result = client("--stop-profile")
        assert result.returncode == 1 and "error: not profiling (0 sessions so far)" in result.stderr
        result = client("--start-profile", "50")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("profiling session 1: steps 0..49 at most")
        assert client("--start-profile").stderr.startswith("error: already profiling (session 1, from step 0)")
        assert client("--max-tokens", "6", "--ignore-eos", "Hello").returncode == 0
        result = client("--stop-profile")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("deltaserve profile, session 1: steps 0..")  # the summary, once merged
        assert {p.name for p in folder.iterdir()} >= {"timeline.json.gz", "summary.txt", "worker-tp0.pt.trace.json.gz"}
        assert client("--start-profile", "2").returncode == 0  # a window of its own: it ends by itself
        assert client("--max-tokens", "6", "--ignore-eos", "Hello again").returncode == 0
        deadline = time.monotonic() + 60
        while not (folder / "session-2" / "summary.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        summary = json.loads((folder / "session-2" / "summary.json").read_text())
        assert summary["last_step"] - summary["first_step"] == 1
        assert client("--start-profile").returncode == 0
        result = client("--stop-profile")  # before any step ran
        assert result.stdout.startswith("deltaserve profile, session 3: no step (stopped before step "), result.stdout
        # A session whose folder cannot be made is refused; one whose folder goes away loses its files. The engine
        # serves on either way.
        (folder / "session-4").write_text("")
        result = client("--start-profile")
        assert result.returncode == 1
        assert f"error: cannot create the session's folder {folder / 'session-4'}: File exists" in result.stderr
        assert client("--max-tokens", "4", "--ignore-eos", "Still there?").returncode == 0
        (folder / "session-4").unlink()
        assert client("--start-profile").returncode == 0
        assert client("--max-tokens", "4", "--ignore-eos", "Hello").returncode == 0
        shutil.rmtree(folder / "session-4")
        result = client("--stop-profile")
        assert result.returncode == 1 and "but merging them failed" in result.stderr, result.stderr
        assert client("--max-tokens", "4", "--ignore-eos", "Still there?").returncode == 0
        assert server.poll() is None
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=180)


def test_client_profile_options_are_used_alone(capsys: pytest.CaptureFixture) -> None:
    for argv, message in [(["--start-profile", "--stop-profile"], "used alone"), (["--stop-profile", "hi"], "alone"),
                          (["--start-profile", "-3"], "must be in [0, 2147483647]"),
                          (["--start-profile", str(2**70)], "must be in [0, 2147483647]"),
                          ([], "give one or more prompts")]:
        with pytest.raises(SystemExit) as exc:
            client_main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
