"""benchmarks/gpu_correctness.py: vLLM's check_logprobs_close rule, and the whole gate script run on CPU
with a tiny checkpoint (the GPU run must not be the first time it runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_correctness import check_logprobs_close, failed_run, our_runs
from tests.conftest import REPO

TOP = [[1, 2, 3, 4, 5]] * 4


def test_identical_runs_pass() -> None:
    assert check_logprobs_close([1, 2, 3], TOP, [1, 2, 3], TOP) == {"identical": True, "ok": True, "position": None}


def test_a_divergence_between_two_top5_tokens_passes_and_nothing_after_it_is_compared() -> None:
    ours_top = [[7, 1, 2, 3, 4], [9, 8, 6, 5, 4], [9], [9]]
    ref_top = [[1, 7, 2, 3, 4], [9], [9], [9]]
    result = check_logprobs_close([7, 100, 200], ours_top, [1, 300, 400], ref_top)
    assert result == {"identical": False, "ok": True, "position": 0, "ranks": [1, 1]}


@pytest.mark.parametrize(("ours", "ref"), [([5, 6], [5, 9]), ([5, 9], [5, 6])])
def test_a_divergence_to_a_token_outside_the_other_runs_top5_fails(ours: list[int], ref: list[int]) -> None:
    tops = [[5, 1, 2, 3, 4], [6, 1, 2, 3, 4]]  # 9 is in neither run's top-5 at position 1
    result = check_logprobs_close(ours, tops, ref, tops)
    assert result["position"] == 1 and not result["ok"]


def test_the_fp8_rule_takes_top8_as_vllms_fp8_test_does() -> None:
    ours_top = [[7, 1, 2, 3, 4, 5, 6, 8]]
    ref_top = [[1, 2, 3, 4, 5, 6, 7, 9]]  # 7 is the reference's 7th most likely token
    assert not check_logprobs_close([7], ours_top, [1], ref_top)["ok"]
    assert check_logprobs_close([7], ours_top, [1], ref_top, k=8) == {"identical": False, "ok": True, "position": 0,
                                                                      "ranks": [6, 1]}


def test_each_divergence_carries_the_references_logit_margin() -> None:
    import torch

    from benchmarks.gpu_correctness import compare

    logits = torch.zeros(2, 10)
    logits[0, 3], logits[1, 4], logits[1, 5] = 1.0, 2.0, 1.75
    ref = {"tokens": [[3, 4]], "top": [[[3, 0, 1, 2, 4], [4, 5, 0, 1, 2]]], "logits": [logits]}
    ours = {"tokens": [[3, 5]], "top": [[[3, 0, 1, 2, 4], [5, 4, 0, 1, 2]]], "logits": [logits]}
    row = compare("ours", ours, ref)
    assert row["identical"] == 0 and row["rule_ok"] == 1 and row["top_k"] == 5
    assert row["divergences"] == [(0, 1, [1, 1], 0.25)]


def test_every_backend_runs_with_graphs_on_and_off_and_both_kv_cache_dtypes() -> None:
    runs = {(backend, eager, kv) for _, backend, eager, kv in our_runs(["triton", "flash-attn", "torch"])}
    assert runs == {("triton", False, "auto"), ("triton", True, "auto"), ("triton", False, "fp8"),
                    ("triton", True, "fp8"), ("flash-attn", False, "auto"), ("flash-attn", True, "auto"),
                    ("torch", True, "auto"), ("torch", True, "fp8")}


def test_a_run_that_raises_fails_the_gate_unless_its_backend_is_not_installed() -> None:
    compile_error = RuntimeError("CompilationError: Cannot access global variable _FLOAT32_TWO_POW_14")
    assert failed_run("deltaserve triton, eager, KV fp8", compile_error)["pass"] is False
    missing = RuntimeError("attention backend 'flash-attn' cannot run here: neither flash-attn-4 nor 2 is installed")
    assert failed_run("deltaserve flash-attn, eager, KV bf16", missing)["pass"] is None
    assert failed_run("deltaserve flash-attn, eager, KV bf16", ImportError("flash_attn"))["pass"] is None


@pytest.mark.slow
def test_the_gate_script_runs_both_gates_and_writes_a_verdict(tiny_qwen3_trained_scale: Path, tmp_path: Path) -> None:
    out = tmp_path / "gates.json"
    env = {k: v for k, v in os.environ.items() if k != "DELTASERVE_STEP_LOG_DIR"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_correctness.py", "--model", str(tiny_qwen3_trained_scale),
                           "--demo-model", str(tiny_qwen3_trained_scale), "--device", "cpu", "--backends", "torch",
                           "--dtype", "float32", "--num-prompts", "4", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1) and out.exists(), proc.stderr[-3000:]  # 1: a gate failed (a verdict is written)
    results = json.loads(out.read_text())
    names = [[r["run"] for r in results[gate]] for gate in ("random_weights", "demo_model")]
    assert names[0] == ["transformers float32, eager attention (floor)", "transformers fp32",
                        "deltaserve torch, eager, KV fp32", "deltaserve torch, eager, KV fp8",
                        "deltaserve torch, eager, KV fp8 vs KV fp32, top-8"]
    assert names[1] == ["transformers float32", "deltaserve torch, eager, KV fp32", "deltaserve torch, eager, KV fp8",
                        "deltaserve torch, eager, KV fp8 vs KV fp32"]
    for rows in results.values():
        for row in rows:
            assert row["prompts"] == 4 and 0 <= row["identical"] <= row["rule_ok"] <= 4
            assert "pass" in row or row["run"].startswith("transformers")
    fp8_vs_plain = results["random_weights"][-1]
    assert fp8_vs_plain["top_k"] == 8 and fp8_vs_plain["pass"] is (fp8_vs_plain["rule_ok"] == 4)
    verdict = "all gates pass" if proc.returncode == 0 else "FAILED"
    assert verdict in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-folder"], "--model 'no-such-folder' is not a folder"),
    (["--demo-model", ".", "--num-prompts", "33"], "--num-prompts must be in 1..32, got 33"),
    (["--demo-model", ".", "--device", "cuda"], "--device cuda (the default) needs a CUDA GPU"),
])
def test_the_gate_script_refuses_bad_arguments_in_one_line(args: list[str], message: str) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_correctness.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
