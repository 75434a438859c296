"""One-shot `launch.py`: progress while the prompts run, TTFT and the decode rate reported apart, and Ctrl-C
printing the text generated so far."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.protocol import RequestOutput
from deltaserve import LLM, SamplingParams
from frontend.client_cli import JSON_METRICS, json_row
from launch import decode_rate, run_prompts
from tests.conftest import REPO
from tests.test_engine_e2e import llm  # noqa: F401  (the engine fixture, started once for this module)

SIX = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_the_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_the_first() -> None:
    assert decode_rate(11, ttft_s=0.5, e2e_s=1.5) == pytest.approx(10.0)  # not 11 / 1.5 = 7.3
    assert decode_rate(1, ttft_s=0.5, e2e_s=0.5) is None  # one token: no decode phase to time
    assert decode_rate(0, ttft_s=0.0, e2e_s=0.1) is None


def test_a_failed_prompts_json_row_has_the_same_keys_as_a_finished_ones_with_null_timings() -> None:
    finished = RequestOutput("a", "Hi", [1, 2], True, "length", None, 3, 0,
                             {"ttft_s": 0.1, "e2e_s": 0.3, "num_preemptions": 0, "queue_s": 0.01})
    refused = RequestOutput("b", finished=True, finish_reason="error", error="too long", num_prompt_tokens=9)

    ok, failed = json_row("x", finished), json_row("y", refused)
    assert list(ok) == list(failed)
    assert ok["ttft_s"] == 0.1 and ok["queue_s"] == 0.01 and ok["prompt"] == "x"
    assert all(failed[key] is None for key in JSON_METRICS) and failed["error"] == "too long"


def test_json_rows_carry_ttft_and_the_decode_rate_and_progress_goes_to_stderr(
        llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    status = run_prompts(llm.engine, ["Hello", "Hi"], SIX, chat=False, as_json=True, progress=True)

    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]  # stdout stays machine-readable: JSON lines only
    assert status == 0 and [r["prompt"] for r in rows] == ["Hello", "Hi"]
    for row in rows:
        assert len(row["token_ids"]) == 6 and row["finish_reason"] == "length"
        assert 0 < row["ttft_s"] < row["e2e_s"]
        assert row["decode_tokens_per_s"] == pytest.approx(5 / (row["e2e_s"] - row["ttft_s"]))
    assert "Generating" in err and "2/2" in err and "12 output tokens" in err, err


def test_the_progress_bar_shows_output_tokens_while_no_prompt_has_finished_yet(
        llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    run_prompts(llm.engine, ["Hello"], long, chat=False, as_json=True, progress=True)

    frames = capsys.readouterr().err.split("\r")  # each redraw of the bar
    assert any(re.search(r" 0/1 \[.*, ([1-9]\d*) output tokens?, ", f) for f in frames), frames


def test_each_answer_shows_ttft_and_decode_rate_and_counts_read_in_the_singular(
        llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    run_prompts(llm.engine, ["Hello"], SIX, chat=False, as_json=False, progress=False)

    out, err = capsys.readouterr()
    assert re.search(r"\[6 tokens, finish: length, TTFT \d+ ms, decode \d+\.\d tok/s\]", out), out
    assert re.search(r"^1 prompt, 6 output tokens in \d+\.\d\d s", out, re.MULTILINE), out
    assert "tok/s]" in out and err == ""  # no bar when asked for none


def _step_count(log_dir: Path) -> int:
    try:
        return sum(1 for _ in open(log_dir / "worker-tp0.jsonl"))
    except OSError:
        return 0


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_prints_the_text_generated_so_far_and_says_it_was_interrupted(
        tiny_qwen3: Path, tmp_path: Path, as_json: bool) -> None:
    """Run from another folder with a relative model path and step-log folder: both mean the caller's folder,
    though the engine's processes start in the repository's."""
    env = {**os.environ, "DELTASERVE_STEP_LOG_DIR": "steps"}
    launcher = subprocess.Popen(
        [sys.executable, str(REPO / "launch.py"), "--model", os.path.relpath(tiny_qwen3, tmp_path), "--device", "cpu",
         "--prompt", "Tell me a story", "--max-tokens", "3000", "--ignore-eos", *(["--json"] if as_json else [])],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as from a terminal, also when these tests run in the background (SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while _step_count(tmp_path / "steps") < 4:  # the prefill and a few decode steps are done: tokens have streamed
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err
    assert "Traceback" not in err, err
    assert "the server was stopped" not in err and "the run was interrupted (Ctrl-C)" in err, err  # nothing served
    # On a CPU a step is computed in full when it starts: its tokens go out before the next step starts, not after.
    steps = [json.loads(line) for line in open(tmp_path / "steps" / "worker-tp0.jsonl")]
    assert all(a["t_done"] <= b["t_start"] for a, b in zip(steps, steps[1:])), steps
    if as_json:
        (row,) = [json.loads(line) for line in out.splitlines()]
        assert row["finish_reason"] == "abort" and row["error"] == "interrupted before it finished"
        assert 1 <= len(row["token_ids"]) < 3000 and row["text"]
    else:
        match = re.search(r"Answer \(interrupted after (\d+) tokens?\): (.+)", out)
        assert match and 1 <= int(match.group(1)) < 3000 and match.group(2), out


def test_answers_to_a_reader_that_left_end_quietly_with_sigpipes_status(tiny_qwen3: Path) -> None:
    """`launch.py --json | head -1` with more lines than head takes: no BrokenPipeError traceback."""
    launcher = subprocess.Popen(
        [sys.executable, "launch.py", "--model", str(tiny_qwen3), "--device", "cpu", "--prompt", "a", "--prompt",
         "b", "--max-tokens", "2", "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    launcher.stdout.close()  # the reader is gone before the first answer is printed
    try:
        err = launcher.stderr.read()
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 141 and "Traceback" not in err, err


def test_a_sampling_seed_gives_a_deterministic_engine_the_same_sampled_answer_alone_and_among_other_prompts(
        tiny_qwen3: Path) -> None:
    """--seed seeds the workers' generator, which hands prompts their seeds in the order they arrive; --sampling-seed
    is each prompt's own (SamplingParams.seed)."""
    def answers(*prompts: str) -> dict[str, dict]:
        args = [sys.executable, "launch.py", "--model", str(tiny_qwen3), "--device", "cpu", "--deterministic",
                "--sampling-seed", "7", "--temperature", "1.0", "--max-tokens", "8", "--ignore-eos", "--logprobs",
                "2", "--json"]
        for p in prompts:
            args += ["--prompt", p]
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return {row["prompt"]: row for row in map(json.loads, done.stdout.splitlines())}

    alone = answers("the sea")["the sea"]
    among = answers("one two", "the sea", "three four five six")["the sea"]
    assert among["token_ids"] == alone["token_ids"] and among["outputs"] == alone["outputs"]  # logprobs too
    bad = subprocess.run([sys.executable, "launch.py", "--sampling-seed", "-1", "--prompt", "x"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--sampling-seed must be an integer in [0, 2**63), got -1" in bad.stderr
