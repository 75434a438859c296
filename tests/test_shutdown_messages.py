"""What a client and the user are told when the engine goes down: the process that ended it, and how,
in one clear line (a traceback only for an error nobody anticipated)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from common.ipc import Endpoints
from deltaserve import EngineClient, SamplingParams
from frontend.launcher import EngineDeadError
from frontend.process import SchedulerSilent, shutdown_reason

LONG = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _run_dir_endpoints(run_dir: Path) -> Endpoints:
    return Endpoints("", "", "", "", "", (), "", str(run_dir))


@pytest.mark.parametrize("victim", ["worker-tp0", "scheduler"])
def test_a_client_is_told_which_process_was_killed_not_that_the_frontend_got_sigterm(
        tiny_qwen3: Path, engine_factory, victim: str) -> None:
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=4096)
    client = EngineClient(llm.engine.endpoints.client, dead_after_s=8)  # a served client: no launcher to watch
    pid = llm.engine.procs[victim].pid
    try:
        outputs = client.generate("Tell me a story", LONG, stream=True)
        next(outputs)  # it is running
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            llm.engine.wait()  # what `launch.py --serve` does: it sees the dead process and stops the others
        out = list(outputs)[-1]
    finally:
        client.close()
    assert out.finished and out.finish_reason == "error"
    assert out.error == f"the engine is shutting down: {victim} exited with code -9 (pid {pid}, killed by SIGKILL)"


def test_a_client_of_an_engine_stopped_on_purpose_hears_that_its_frontend_got_sigterm(
        tiny_qwen3: Path, engine_factory) -> None:
    """Ctrl-C of the server (or `LLM.shutdown`) stops every process with SIGTERM: no process died first."""
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=4096)
    client = EngineClient(llm.engine.endpoints.client, dead_after_s=8)
    try:
        outputs = client.generate("Tell me a story", LONG, stream=True)
        next(outputs)
        stopper = threading.Thread(target=llm.engine.shutdown)
        stopper.start()
        out = list(outputs)[-1]
        stopper.join()
    finally:
        client.close()
    assert out.finish_reason == "error"
    assert out.error == "the engine is shutting down (its frontend process got SIGTERM)"


def test_the_reason_the_launcher_leaves_is_what_the_frontend_tells_on_its_sigterm(tmp_path: Path) -> None:
    endpoints = _run_dir_endpoints(tmp_path)
    endpoints.write_stop_reason("worker-tp0 exited with code -9 (pid 12, killed by SIGKILL)")
    reason = endpoints.read_stop_reason()
    assert reason == "worker-tp0 exited with code -9 (pid 12, killed by SIGKILL)"
    assert shutdown_reason(SystemExit(128 + signal.SIGTERM), reason) == (
        "the engine is shutting down: worker-tp0 exited with code -9 (pid 12, killed by SIGKILL)")


def test_a_frontend_that_stops_first_tells_its_own_reason(tmp_path: Path) -> None:
    silent = SchedulerSilent("the scheduler has sent nothing for 31 s")
    assert shutdown_reason(silent, "scheduler exited with code 1 (pid 12)") == str(silent)
    interrupted = "the engine is shutting down (its frontend process was interrupted)"
    assert shutdown_reason(KeyboardInterrupt(), "x") == interrupted


@pytest.mark.parametrize("left", ["nothing", "not utf-8", "a folder"])
def test_a_reason_that_cannot_be_read_leaves_the_sigterm_wording(tmp_path: Path, left: str) -> None:
    """The frontend fails its pending requests at once all the same: reading never raises."""
    path = tmp_path / "stop-reason"
    if left == "not utf-8":
        path.write_bytes(b"\xff\xfe\xfd")
    elif left == "a folder":
        path.mkdir()
    reason = _run_dir_endpoints(tmp_path).read_stop_reason()
    assert reason is None
    assert shutdown_reason(SystemExit(128 + signal.SIGTERM), reason) == (
        "the engine is shutting down (its frontend process got SIGTERM)")


def test_a_firing_step_watchdog_is_reported_once_as_its_message_without_a_traceback(
        tiny_qwen3: Path, engine_factory, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    """The launcher reports it (here as the EngineDeadError): the scheduler does not log it a second time."""
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_S", "2")
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=256)
    assert llm.generate(["warm"], GREEDY8, use_tqdm=False)[0]["token_ids"]
    os.kill(llm.engine.procs["worker-tp0"].pid, signal.SIGSTOP)
    with pytest.raises(EngineDeadError, match=r"scheduler: step \d+ has not finished after \d+ s "
                                              r"\(its bound is 2 s: DELTASERVE_STEP_TIMEOUT_S=2"):
        llm.generate(["still there?"], GREEDY8, use_tqdm=False)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "[scheduler] fatal error" not in err, err
