"""A profiled GPU run: the worker's trace holds the kernels of its CUDA-graph replays, and the summary's
device idle between steps agrees with the step log's CUDA-event figure. Skipped without CUDA; run on the
device with `bash scripts/gpu_tests.sh` (the reference workload's profiled run is in scripts/gpu_bench.sh)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from deltaserve import SamplingParams
from tests.conftest import synthetic_prompt

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_a_profiled_gpu_run_shows_graph_replay_kernels_and_its_gaps_agree_with_the_step_log(
        engine_factory, tiny_qwen3: Path, tmp_path: Path) -> None:
    folder = tmp_path / "profile"
    llm = engine_factory(tiny_qwen3, device="cuda", max_num_seqs=16, cuda_graph_sizes=[1, 2, 4, 8, 16],
                         kv_cache_memory_gb=1.0, profile_dir=str(folder), profile_steps="none")
    prompts = [synthetic_prompt(64, seed) for seed in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts, greedy, use_tqdm=False)  # warm-up: compilation and first launches stay out of the trace
    llm.start_profile(num_steps=1000)
    llm.generate(prompts, greedy, use_tqdm=False)
    status = llm.stop_profile()
    assert "device cuda:0: busy" in status.summary

    with gzip.open(folder / "worker-tp0.pt.trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"}
    replayed = [e for e in events if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches]
    assert launches and len(replayed) > len(launches)  # each replay ran the graph's many kernels
    assert any(e.get("cat") == "user_annotation" and e["name"].startswith("graph replay [step") for e in events)

    device = json.loads((folder / "summary.json").read_text())["processes"]["worker-tp0"]["device_activity"]
    assert device["activity"] and 0.0 < device["busy_share"] <= 1.0
    assert device["gaps"] >= 40 and device["step_log_gaps"] == device["gaps"]
    # Two measures of the same gaps: the trace's kernels and copies, and the step log's CUDA events.
    assert device["gap_total_ms"] == pytest.approx(device["step_log_gap_total_ms"], rel=0.10,
                                                   abs=0.01 * device["gaps"])
