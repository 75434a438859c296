"""Each engine process sets its own torch threads: 1 in the frontend, the scheduler and the HTTP servers; a CPU worker
the cores given to it divided among the tensor-parallel ranks; a GPU worker 1; DELTASERVE_WORKER_THREADS (or
OMP_NUM_THREADS) chooses for the workers. torch's default, a thread per core in every process, made decode on a
loaded 2-core host 50-100x slower."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import EngineConfig
from common.ipc import free_port, hold_port
from frontend.launcher import EngineProcesses, HTTPOptions
from tests.conftest import REPO
from workers.process import GPU_WORKER_THREADS, cores_given, worker_torch_threads


@pytest.mark.parametrize(("cores", "device", "tp", "expected"), [
    (8, "cpu", 1, 8), (8, "cpu", 2, 4), (8, "cpu", 3, 2), (2, "cpu", 4, 1), (64, "cuda", 8, GPU_WORKER_THREADS),
])
def test_a_worker_takes_its_share_of_the_cores_it_is_given_on_cpu_and_one_thread_on_a_gpu(
        monkeypatch: pytest.MonkeyPatch, cores: int, device: str, tp: int, expected: int) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("DELTASERVE_WORKER_THREADS", raising=False)
    monkeypatch.setattr("workers.process.cores_given", lambda: cores)
    assert worker_torch_threads(device, tp) == expected


def test_deltaserve_worker_threads_then_omp_num_threads_choose_a_workers_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("workers.process.cores_given", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_torch_threads("cpu", 2) == worker_torch_threads("cuda", 2) == 3  # the user's choice wins
    monkeypatch.setenv("DELTASERVE_WORKER_THREADS", "5")
    assert worker_torch_threads("cpu", 2) == worker_torch_threads("cuda", 2) == 5  # ours wins over OMP's


def test_threads_set_before_torch_is_imported_are_the_threads_torch_uses() -> None:
    """The frontend imports torch (through transformers) after it set its threads: torch must take them."""
    code = ("from common.proc import set_torch_threads, torch_threads; set_torch_threads(1); "
            "assert torch_threads() == 1; import torch; print(torch.get_num_threads(), torch_threads())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PATH": "", "OMP_NUM_THREADS": str(max(2, cores_given()))}).stdout
    assert out.split() == ["1", "1"]


def test_every_engine_process_reports_the_threads_it_runs_torch_with(
        tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OMP_NUM_THREADS (tests/conftest.py sets it for every other engine): torch's own default would be one
    thread per core in each of these processes."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("DELTASERVE_WORKER_THREADS", raising=False)
    port = free_port()
    config = EngineConfig(model=str(tiny_qwen3), device="cpu", block_size=16, max_model_len=256)
    engine = EngineProcesses(config, http=HTTPOptions("127.0.0.1", port, hold_port("127.0.0.1", port)))
    try:
        engine.start()
        threads = {name: info["torch_threads"] for name, info in engine.process_info.items()}
    finally:
        engine.shutdown()
    assert threads == {"frontend": 1, "scheduler": 1, "http-0": 1, "worker-tp0": cores_given()}
