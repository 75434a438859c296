"""The engine as users meet it when it starts, serves and stops: `launch.py --serve` with the client CLI,
one-shot runs, Ctrl-C and SIGTERM, and a process that dies or stops (each engine here is its own, since
every test ends it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from common.ipc import free_port
from common.protocol import GenerateRequest, Submit, encode
from deltaserve import LLM, EngineClient, SamplingParams
from frontend.launcher import EngineDeadError
from tests.conftest import REPO, wait_until_serving

GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ----------------------------------------------------------------------------- serving, CLI, shutdown
def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "")
            if ppid == str(pid):
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


@pytest.fixture
def run_root():
    """A short private temporary folder for a served engine's socket folder (AF_UNIX paths are limited to
    about 100 bytes), so a test sees exactly its engine's folder, not those of engines started meanwhile."""
    root = Path(tempfile.mkdtemp(prefix="dst-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _serve(model: Path, port: int, run_root: Path) -> tuple[subprocess.Popen, list[int], Path]:
    """`launch.py --serve` of `model` on CPU, its temporary folder `run_root`, once it says it serves:
    (the launcher, its child processes, its socket folder)."""
    server = subprocess.Popen([sys.executable, "launch.py", "--model", str(model), "--serve", "--port", str(port),
                               "--device", "cpu", "--max-model-len", "256"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(run_root)})
    wait_until_serving(server)
    (run_dir,) = run_root.glob("deltaserve-*")
    return server, _children(server.pid), run_dir


@pytest.mark.parametrize(("stop_signal", "how"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_serve_answers_the_client_cli_then_stops_cleanly_and_tells_a_waiting_client_why(
        tiny_qwen3: Path, run_root: Path, stop_signal: int, how: str) -> None:
    """One server for both (a start is most of the time): the client CLI is answered; stopped by its operator
    while a request runs, the server tells that client why, and leaves no process, socket folder or port behind.
    (An idle server stopped by Ctrl-C: test_repeated_ctrl_c_during_shutdown_still_removes_everything.)"""
    port = free_port()
    server, children, run_dir = _serve(tiny_qwen3, port, run_root)
    client, t0, out = None, None, None
    try:
        assert len(children) == 3  # frontend, scheduler, one worker
        result = subprocess.run([sys.executable, "-m", "frontend.client", "--port", str(port), "--max-tokens", "8",
                                 "--ignore-eos", "Hello there"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        result = subprocess.run([sys.executable, "-m", "frontend.client", "--port", str(port), "--json",
                                 "--max-tokens", "4", "one", "two"], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        rows = [json.loads(line) for line in result.stdout.splitlines()]
        assert [r["prompt"] for r in sorted(rows, key=lambda r: r["prompt"])] == ["one", "two"]
        assert all(r["finish_reason"] in ("stop", "length") and r["token_ids"] for r in rows)
        client = EngineClient(f"tcp://127.0.0.1:{port}", dead_after_s=8)
        outputs = client.generate("Tell me a story", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        next(outputs)  # it is running
        t0 = time.monotonic()
        server.send_signal(stop_signal)
        out = list(outputs)[-1]
    finally:
        if client is not None:
            client.close()
        if t0 is None:  # failed before the stop: stop it anyway
            t0 = time.monotonic()
            server.send_signal(stop_signal)
        code = server.wait(timeout=30)
    assert time.monotonic() - t0 < 15
    assert code == 128 + stop_signal  # 130 for Ctrl-C, 143 for SIGTERM, as shells report them
    assert out.finish_reason == "error"
    assert out.error == f"the engine is shutting down: the server was stopped ({how})", out.error
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children), "engine processes outlived the launcher"
    assert not run_dir.exists(), "socket folder left behind"
    # Nothing listens on the client port any more. SO_REUSEADDR: the stopped request's connection may linger in
    # TIME_WAIT, which alone refuses a plain bind; a listener would still refuse this one.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_repeated_ctrl_c_during_shutdown_still_removes_everything(tiny_qwen3: Path, run_root: Path) -> None:
    """Impatient users press Ctrl-C again while the engine stops: that must hurry the stop, not abandon it
    half-way with the socket folder left behind."""
    server, children, run_dir = _serve(tiny_qwen3, free_port(), run_root)
    server.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 15
    while server.poll() is None and time.monotonic() < deadline:  # Ctrl-C, Ctrl-C, Ctrl-C, ...
        time.sleep(0.01)
        server.send_signal(signal.SIGINT)
    code = server.wait(timeout=15)
    stderr = server.stderr.read()
    assert code == 130 and "Traceback" not in stderr, stderr
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children), "engine processes outlived the launcher"
    assert not run_dir.exists(), "socket folder left behind"


def test_one_shot_json_output(tiny_qwen3: Path) -> None:
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--device", "cpu",
                             "--prompt", "Hello", "--prompt", "", "--max-tokens", "5", "--ignore-eos", "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=180)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2
    assert set(rows[0]) >= {"text", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens"}
    assert len(rows[0]["token_ids"]) == 5 and rows[0]["finish_reason"] == "length"
    assert rows[1]["finish_reason"] == "error" and "empty" in rows[1]["error"]
    assert result.returncode == 1  # one prompt failed


def test_a_killed_worker_brings_the_engine_down_with_a_clear_message(tiny_qwen3: Path, engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=256)
    pids = {name: p.pid for name, p in llm.engine.procs.items()}
    os.kill(pids["worker-tp0"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker-tp0 exited with code -9"):
        llm.generate(["anyone there?"], GREEDY8, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values())
    with pytest.raises(EngineDeadError):
        llm.generate(["again"], GREEDY8, use_tqdm=False)


def _idle_then_stop(engine_factory, model: Path, process: str) -> LLM:
    """An engine that served, idled past the 3 s heartbeat timeouts the caller set (idle processes still
    ping), served again, and then had `process` SIGSTOPped."""
    llm = engine_factory(model, block_size=16, max_model_len=256)
    assert llm.generate(["warm"], GREEDY8, use_tqdm=False)[0]["token_ids"]
    time.sleep(4)
    assert llm.generate(["warm"], GREEDY8, use_tqdm=False)[0]["token_ids"]
    os.kill(llm.engine.procs[process].pid, signal.SIGSTOP)
    return llm


def test_a_stopped_scheduler_fails_the_requests_and_brings_the_engine_down(tiny_qwen3: Path, engine_factory,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped scheduler does not exit and the frontend still answers client pings, so without its
    heartbeat a client would wait forever: the frontend fails the requests and ends the engine instead."""
    monkeypatch.setenv("DELTASERVE_SCHEDULER_TIMEOUT_S", "3")
    llm = _idle_then_stop(engine_factory, tiny_qwen3, "scheduler")
    client = EngineClient(llm.engine.endpoints.client)  # a served client: no launcher to watch
    t0 = time.monotonic()
    try:
        out = list(client.generate("anyone there?", GREEDY8, stream=False))[-1]
    finally:
        client.close()
    assert out.finish_reason == "error" and "the scheduler has sent nothing" in out.error
    assert "DELTASERVE_SCHEDULER_TIMEOUT_S=3" in out.error
    assert time.monotonic() - t0 < 15
    with pytest.raises(EngineDeadError, match="the scheduler has sent nothing"):
        llm.generate(["again"], GREEDY8, use_tqdm=False)
    llm.shutdown()
    assert all(p.poll() is not None for p in llm.engine.procs.values())


def test_a_stopped_frontend_ends_the_engine_with_a_message(tiny_qwen3: Path, engine_factory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped frontend does not exit, so the launcher cannot see it: the scheduler, which hears its
    ping every second, ends the engine instead of leaving it up and unreachable forever."""
    monkeypatch.setenv("DELTASERVE_FRONTEND_TIMEOUT_S", "3")
    llm = _idle_then_stop(engine_factory, tiny_qwen3, "frontend")
    t0 = time.monotonic()
    stopped_and_why = r"frontend \(pid \d+\) is stopped.* sent nothing .*DELTASERVE_FRONTEND_TIMEOUT_S=3"
    with pytest.raises(EngineDeadError, match=stopped_and_why):
        llm.engine.wait()  # what `launch.py --serve` does
    assert time.monotonic() - t0 < 15
    llm.shutdown()
    assert all(p.poll() is not None for p in llm.engine.procs.values())


@pytest.mark.parametrize("how", ["frontend-sigterm", "worker-sigkill"])
def test_a_client_hears_at_once_that_the_engine_went_down(tiny_qwen3: Path, engine_factory, how: str) -> None:
    """An engine going down (SIGTERM, Ctrl-C of the server, or a dead process after which the launcher stops
    the rest) must send each pending request an error at once, not leave its client to time out in silence."""
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=4096)
    client = EngineClient(llm.engine.endpoints.client, dead_after_s=8)  # a served client: no launcher to watch
    try:
        long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
        outputs = client.generate("Tell me a story", long, stream=True)
        text = next(outputs).text  # it is running
        t0 = time.monotonic()
        if how == "frontend-sigterm":
            os.kill(llm.engine.procs["frontend"].pid, signal.SIGTERM)
        else:  # what `launch.py --serve` does: its wait() sees the dead worker and stops the others
            os.kill(llm.engine.procs["worker-tp0"].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="worker-tp0 exited with code -9"):
                llm.engine.wait()
        for out in outputs:
            text += out.text
    finally:
        client.close()
    assert time.monotonic() - t0 < 5
    assert out.finished and out.finish_reason == "error"
    assert "the engine is shutting down" in out.error, out.error
    assert ("SIGTERM" if how == "frontend-sigterm" else "worker-tp0 exited with code -9") in out.error, out.error
    assert text


def test_shutdown_stops_every_process_promptly_without_sigkill(tiny_qwen3: Path) -> None:
    llm = LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=256)
    llm.generate(["warm up"], GREEDY8, use_tqdm=False)
    procs = dict(llm.engine.procs)
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < 5
    assert all(p.returncode != -signal.SIGKILL for p in procs.values()), {n: p.returncode for n, p in procs.items()}


def test_requests_of_a_client_that_went_away_are_aborted(tiny_qwen3: Path, engine_factory,
                                                         monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    monkeypatch.setenv("DELTASERVE_CLIENT_SILENCE_S", "2")
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=4096, log_level="WARNING")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(llm.engine.endpoints.client)
    sock.send(encode(Submit([GenerateRequest("orphan", prompt="hello", stream=True,
                                             sampling={"max_tokens": 4000, "ignore_eos": True})])))
    assert sock.poll(30_000)  # it is running
    sock.close()  # gone without an Abort
    deadline = time.monotonic() + 20
    err = ""
    while "1 client went silent: aborting their 1 request" not in err and time.monotonic() < deadline:
        time.sleep(0.5)
        err += capfd.readouterr().err
    assert "1 client went silent: aborting their 1 request" in err
    assert len(llm.generate(["others are served"], GREEDY8, use_tqdm=False)[0]["token_ids"]) == 8


def test_a_killed_launcher_takes_its_processes_and_socket_folder_with_it(tiny_qwen3: Path, run_root: Path) -> None:
    server, children, run_dir = _serve(tiny_qwen3, free_port(), run_root)
    server.kill()
    server.wait()
    deadline = time.monotonic() + 10
    while (any(_alive(c) for c in children) or run_dir.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children)
    assert not run_dir.exists()
