"""`launch.py --serve` takes its port before it loads the model and keeps it until its frontend serves
on it: a second server on the same port is refused at once, even while the first is still loading."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from common.ipc import free_port
from tests.conftest import REPO, wait_until_serving


def _serve_command(model: Path, port: int) -> list[str]:
    return [sys.executable, "launch.py", "--model", str(model), "--serve", "--port", str(port), "--device", "cpu",
            "--max-model-len", "256"]


def _has_children(pid: int) -> bool:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                return True
        except OSError:  # the process ended meanwhile
            continue
    return False


def test_a_second_server_on_the_port_of_one_still_loading_is_refused_at_once_and_the_first_serves(
        tiny_qwen3: Path) -> None:
    port = free_port()
    first = subprocess.Popen(_serve_command(tiny_qwen3, port), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _has_children(first.pid):  # past its port check, starting the processes that load the model
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.01)
        t0 = time.monotonic()
        second = subprocess.run(_serve_command(tiny_qwen3, port), cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        assert time.monotonic() - t0 < 10
        assert second.returncode == 2
        assert second.stderr.splitlines() == [f"launch.py: error: cannot serve on 127.0.0.1:{port}: Address already "
                                              f"in use (is another engine serving there? choose --port)"]
        wait_until_serving(first)  # the banner is a status line: stderr, as every other one
        client = subprocess.run([sys.executable, "-m", "frontend.client", "--port", str(port), "--max-tokens", "4",
                                 "--ignore-eos", "Hello"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=30)
    assert "Traceback" not in first.stderr.read()
    assert first.stdout.read() == ""  # a server has no answers of its own to print
