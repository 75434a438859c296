"""Tensor parallelism on CPU when things go wrong: a TP size that does not fit the model, a rank killed or
stopped mid-run, and a rank started by hand that joins over TCP (the multi-host recipe). The numerics of TP=2
are in tests/test_tensor_parallel.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.config import ConfigError, EngineConfig
from deltaserve import LLM, SamplingParams
from frontend.launcher import EngineDeadError, EngineProcesses
from tests.conftest import REPO
from tests.test_engine_vs_hf import ID_PROMPTS, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_tp_size_that_does_not_divide_the_heads_is_refused_at_start(tiny_qwen3: Path) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        LLM(str(tiny_qwen3), tensor_parallel_size=3)


def test_a_killed_rank_brings_the_engine_down_within_seconds(tiny_qwen3: Path, engine_factory, capfd) -> None:
    """The message names the killed rank first; the survivor, which lost it in a collective, reports that
    consequence in one line, not a traceback."""
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=256, tensor_parallel_size=2)
    pids = {name: p.pid for name, p in llm.engine.procs.items()}
    capfd.readouterr()
    os.kill(pids["worker-tp1"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"^worker-tp1 exited with code -9 \(pid \d+, killed by SIGKILL\)"):
        llm.generate(["still there?"] * 4, GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    time.sleep(1)
    assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
               for pid in pids.values())


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stopped_worker_brings_the_engine_down_after_the_step_timeout(
        tp: int, tiny_qwen3: Path, engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that stops making progress without exiting (SIGSTOP here; a hung device or a peer
    lost inside a collective alike) would leave requests waiting forever: the scheduler's step
    watchdog ends the engine with a message instead, and shutdown reaps the stopped process."""
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_S", "2")
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=256, tensor_parallel_size=tp)
    assert llm.generate(["warm"], GREEDY, use_tqdm=False)[0]["token_ids"]  # healthy steps are not timed out
    time.sleep(4)  # idle for twice the timeout: an idle engine is not stuck
    assert llm.generate(["warm"], GREEDY, use_tqdm=False)[0]["token_ids"]
    worker = llm.engine.procs[f"worker-tp{tp - 1}"]
    os.kill(worker.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="has not finished after .* a worker is stuck") as err:
        llm.generate(["still there?"] * 4, GREEDY, use_tqdm=False)
    assert str(err.value).startswith(f"worker-tp{tp - 1} (pid {worker.pid}) is stopped")  # the culprit, named
    assert time.monotonic() - t0 < 15
    llm.shutdown()
    assert all(p.poll() is not None for p in llm.engine.procs.values())


def test_a_worker_started_by_hand_joins_over_tcp(tiny_qwen3: Path) -> None:
    """The multi-host recipe on one host: rank 1 is started from the command the launcher prints,
    reaching the scheduler and the torch.distributed rendezvous over tcp:// addresses."""
    started: list[subprocess.Popen] = []

    def start_elsewhere(rank: int, argv: list[str], env: dict[str, str]) -> None:
        env = {**os.environ, **env, "PYTHONPATH": str(REPO)}  # the printed command sets the same variables
        started.append(subprocess.Popen(argv, cwd=REPO, env=env))

    config = EngineConfig(model=str(tiny_qwen3), device="cpu", block_size=16, max_model_len=512,
                          tensor_parallel_size=2)
    engine = EngineProcesses(config, transport="tcp", local_ranks=[0], on_external_worker=start_elsewhere)
    assert all(a.startswith("tcp://") for a in (engine.endpoints.client, engine.endpoints.dist_init,
                                                 *engine.endpoints.plans))
    from deltaserve import EngineClient

    try:
        engine.start()
        assert set(engine.procs) == {"worker-tp0", "scheduler", "frontend"} and len(started) == 1
        client = EngineClient(engine.endpoints.client, liveness=engine.check, curve=engine.client_keys())
        out = list(client.generate(ID_PROMPTS[1], GREEDY, stream=False))[-1]
        client.close()
        assert out.token_ids == hf_greedy(str(tiny_qwen3), tuple(ID_PROMPTS[1]))
    finally:
        engine.shutdown()
        for p in started:  # the scheduler's goodbye ends the worker started by hand
            assert p.wait(timeout=30) in (0, 1)
