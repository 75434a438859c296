"""benchmarks/latency.py on CPU: it runs vLLM's benchmark_latency shape through `LLM` and reports
numbers that belong together (a tiny checkpoint; the speeds themselves are measured on the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def run_latency(model: Path, out: Path, *args: str) -> list[dict]:
    tmp = out.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "DELTASERVE_STEP_LOG_DIR"} | {"TMPDIR": str(tmp)}
    subprocess.run([sys.executable, "benchmarks/latency.py", "--model", str(model), "--device", "cpu",
                    "--num-iters-warmup", "1", "--num-iters", "2", "--json", str(out), *args],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    assert not list(tmp.glob("deltaserve-latency-steps-*"))  # its own step-log folder is removed when it is done
    return json.loads(out.read_text())


def test_decode_latency_reports_ttft_tpot_and_per_token_latency_for_each_batch_size(tiny_qwen3: Path,
                                                                                   tmp_path: Path) -> None:
    one, r = run_latency(tiny_qwen3, tmp_path / "decode.json", "--input-len", "12", "--output-len", "6",
                         "--batch-size", "1", "3")
    assert one["batch_size"] == 1 and one["decode_tokens_per_s"] == 1 / one["tpot_s"]["mean"]
    assert (r["batch_size"], r["input_len"], r["output_len"], r["num_iters"]) == (3, 12, 6, 2)
    assert r["num_cached_tokens"] == 0  # fresh prompts every iteration: no prefix-cache hits
    assert 0 < r["ttft_s"]["mean"] < r["latency_s"]["mean"]
    assert 0 < r["tpot_s"]["p50"] <= r["tpot_s"]["p99"]
    # Every request runs in every decode step: a token per step each, so TPOT is the step time. Medians: on a
    # shared 2-core machine one slow step moved a mean of 5 steps by 60% (a full-suite run, 2026-12-01).
    tpot, per_token = r["tpot_s"]["p50"], r["per_token_latency_s"]["p50"]
    assert abs(tpot - per_token) < 0.5 * max(tpot, per_token)
    assert r["decode_tokens_per_s"] == 3 / r["tpot_s"]["mean"]
    assert r["output_tokens_per_s"] == 3 * 6 / r["latency_s"]["mean"]
    assert r["cuda_graphs"] is False and r["devices"] == ["cpu"]


def test_prefill_mode_reports_prompt_tokens_per_second(tiny_qwen3: Path, tmp_path: Path) -> None:
    (r,) = run_latency(tiny_qwen3, tmp_path / "prefill.json", "--input-len", "40", "--output-len", "1",
                       "--batch-size", "4", "--kv-cache-dtype", "fp8")
    assert r["tpot_s"] is None and r["decode_tokens_per_s"] is None
    assert r["prompt_tokens_per_s"] > 0
    assert r["prompt_tokens_per_s"] >= 4 * 40 / r["latency_s"]["p99"]  # the prefill ends before generate returns
    assert r["kv_cache_dtype"] == "fp8"


def test_a_profiled_run_traces_the_steps_it_names(tiny_qwen3: Path, tmp_path: Path) -> None:
    (r,) = run_latency(tiny_qwen3, tmp_path / "profiled.json", "--input-len", "12", "--output-len", "10",
                       "--batch-size", "1", "--profile-dir", str(tmp_path / "prof"), "--profile-steps", "12:16")
    assert r["decode_tokens_per_s"] > 0
    summary = (tmp_path / "prof" / "summary.txt").read_text()
    assert "steps 12..15" in summary
    assert (tmp_path / "prof" / "worker-tp0.pt.trace.json.gz").exists()


def test_bad_profiling_flags_are_one_line_errors(tiny_qwen3: Path) -> None:
    for flags, message in ((["--profile-steps", "3:6"], "--profile-steps needs --profile-dir"),
                           (["--profile-dir", "/tmp", "--profile-steps", "6:3"], "profile_steps must be 'A:B'"),
                           (["--device", "gpu"], "device must be one of")):
        done = subprocess.run([sys.executable, "benchmarks/latency.py", "--model", str(tiny_qwen3), *flags],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_host_chain_adds_up_the_parts_between_a_steps_tokens_and_the_launch_that_needs_them() -> None:
    sys.path.insert(0, str(REPO))
    from benchmarks.latency import CHAIN_PARTS, host_chain

    def worker(step: int, t: float) -> dict:  # step `step` launched at t, its tokens on the host 1 ms later
        return {"step": step, "decode": True, "t_start": t, "prepare_ms": 0.05, "launch_ms": 0.10,
                "t_tokens": t + 1e-3, "t_result_sent": t + 1.02e-3, "t_done": t + 1.01e-3, "gpu_ms": 0.9}

    steps = [worker(k, k * 1e-3) for k in range(6)]
    # The plan of step k+2 is sent after step k's result: it arrived 0.03 ms after it was sent, took 0.04 ms.
    plans = [{"step": k + 2, "after_result": k, "t_result": steps[k]["t_result_sent"] + 3e-5, "result_ms": 0.04,
              "t_sent": steps[k]["t_result_sent"] + 3e-5 + 4e-5 + 6e-5} for k in range(4)]
    for k, plan in enumerate(plans):
        steps[k + 2]["t_start"] = plan["t_sent"] + 2e-5
    chain = host_chain(steps, plans, [(0.0, 1.0)])
    assert chain is not None
    expected = {"worker": 2e-5, "to scheduler": 3e-5, "result": 4e-5, "schedule": 6e-5, "to worker": 2e-5,
                "launch": 1.5e-4}
    for name in CHAIN_PARTS:
        assert abs(chain[name] - expected[name]) < 1e-9, name
    assert abs(chain["total"] - sum(expected.values())) < 1e-9
    assert abs(chain["device_step"] - 0.9e-3) < 1e-12
    assert host_chain(steps, plans, [(5.0, 6.0)]) is None  # no step of the window
    # Three steps in flight: the plan of step k+3 follows step k's result, with two device steps in between.
    three = [{**plan, "step": plan["after_result"] + 3} for plan in plans[:3]]
    chain = host_chain(steps, three, [(0.0, 1.0)])
    assert chain is not None and abs(chain["device_step"] - 1.8e-3) < 1e-12
    assert host_chain([{k: v for k, v in s.items() if k != "t_tokens"} for s in steps], plans, [(0.0, 1.0)]) is None


def test_a_steps_in_flight_the_engine_refuses_is_a_one_line_error_in_the_benchmarks(tiny_qwen3: Path) -> None:
    for script in ("benchmarks/latency.py", "benchmarks/structured_output.py"):
        done = subprocess.run([sys.executable, script, "--model", str(tiny_qwen3), "--max-steps-in-flight", "5"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (script, done.stderr)
        assert "max_steps_in_flight must be an integer in [1, 4], got 5" in done.stderr, (script, done.stderr)
        assert "Traceback" not in done.stderr, (script, done.stderr)
