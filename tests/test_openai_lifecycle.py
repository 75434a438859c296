"""The HTTP server's life: 503 while the engine starts, a clean stop (Ctrl-C) that tells open streams why,
a dying HTTP process that takes the engine down naming itself, and the built-in demo model over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from common.ipc import free_port
from frontend.default_model import ensure_default_model
from tests.conftest import REPO
from tests.openai_server import API_KEY, http_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _children(pid: int) -> dict[str, int]:
    """Process title ("deltaserve-http-0", as `ps` shows it) -> pid, among the children of `pid`."""
    out = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" not in status.read_text():
                continue
            title = (status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode().split()
        except OSError:
            continue
        if title and title[0].startswith("deltaserve-"):
            out[title[0]] = int(status.parent.name)
    return out


def test_503_while_the_engine_starts_then_it_serves_and_ctrl_c_tells_open_streams_why(tiny_qwen3: Path,
                                                                                      tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "launch.py", "--model", str(tiny_qwen3), "--http-port", str(port), "--device", "cpu",
           "--max-model-len", "512"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not statuses or statuses[-1] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                response = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": "Hi", "max_tokens": 2})
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "engine_unavailable"
            time.sleep(0.05)
        assert statuses[0] == 503, statuses  # the port answers long before the model is loaded
        assert set(statuses) == {503, 200}
        assert httpx.get(f"{url}/health").status_code == 200

        body = {"prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "engine_unavailable" and "the server was stopped (Ctrl-C)" in error["message"]
    assert "Traceback" not in proc.stderr.read()


def test_two_http_processes_share_the_port_and_the_metrics_and_a_killed_one_ends_the_engine(
        tiny_qwen3: Path, tmp_path: Path) -> None:
    with http_server(tiny_qwen3, tmp_path, "--max-model-len", "256", "--api-server-count", "2") as server:
        names = _children(server.process.pid)
        assert {"deltaserve-http-0", "deltaserve-http-1", "deltaserve-frontend", "deltaserve-scheduler",
                "deltaserve-worker-tp0"} <= set(names)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        results: list[str] = []

        def ask() -> None:  # fresh connections: the kernel spreads them over both processes
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
                results.append(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0,
                                                                  "ignore_eos": True}).json()["choices"][0]["text"])

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 8 and len(set(results)) == 1
        assert client.models.list().data[0].id == Path(tiny_qwen3).name
        counts = {server.metrics()["deltaserve:request_success_total{finished_reason=length}"] for _ in range(6)}
        assert counts == {8.0}  # the engine's numbers, whichever process answers

        os.kill(names["deltaserve-http-1"], signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1
    assert "http-1 exited with code -9" in server.stderr() and "killed by SIGKILL" in server.stderr()


@pytest.fixture(scope="module")
def smollm2() -> str:
    return ensure_default_model(verbose=False)


def test_the_demo_model_answers_over_http_with_the_openai_client(smollm2: str, tmp_path: Path) -> None:
    with http_server(smollm2, tmp_path, "--max-model-len", "1024", api_key=None) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        answer = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32)
        assert answer.choices[0].message.content == "The capital of France is Paris."
        assert answer.choices[0].finish_reason == "stop"
        streamed = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            "The capital of France is Paris."
