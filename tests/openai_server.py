"""An HTTP server started as a user starts it (`launch.py --http-port`), for the OpenAI API tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.ipc import free_port
from tests.conftest import REPO, SERVING_BANNER

API_KEY = "test-key-123"


@dataclass
class HTTPServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    stderr_path: Path
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{label=value,...}": value} (labels sorted, model_name left out)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_metrics(self, done: callable, timeout_s: float = 30.0) -> dict[str, float]:
        """The first /metrics for which `done(metrics)` holds; raises AssertionError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if done(m):
                return m
            assert time.monotonic() < deadline, f"metrics never got there: {m}"
            time.sleep(0.05)


def _lower_nofile(soft: int | None, hard: int | None) -> Callable[[], None] | None:
    if soft is None and hard is None:
        return None

    def lower() -> None:
        import resource

        hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard is None else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard_now if soft is None else soft, hard_now))

    return lower


def http_process_pid(launcher_pid: int, index: int = 0) -> int:
    """The pid of the launcher's child deltaserve-http-INDEX, from /proc."""
    title = f"deltaserve-http-{index}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                name = f.read().split(b"\0")[0]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher_pid and name.split(b" ")[0] == title:
            return int(entry.name)
    raise AssertionError(f"no {title.decode()} process")


@contextlib.contextmanager
def http_server(model: Path | str, tmp_path: Path, *extra: str, api_key: str | None = API_KEY,
                timeout_s: float = 300.0, soft_nofile: int | None = None,
                hard_nofile: int | None = None) -> Iterator[HTTPServer]:
    """`launch.py --model MODEL --http-port P --device cpu ...` until it says on stderr that it serves; stopped with
    Ctrl-C (SIGINT) at the end, which must end it cleanly. `soft_nofile`, `hard_nofile`: the launcher starts with
    this soft or hard RLIMIT_NOFILE (as under a shell's `ulimit -Sn` or `ulimit -Hn`; the soft one follows a
    lowered hard one)."""
    port = free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    stderr_path = tmp_path / "server.stderr"
    cmd = [sys.executable, "launch.py", "--model", str(model), "--http-port", str(port), "--device", "cpu", *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env,
                                start_new_session=True, preexec_fn=_lower_nofile(soft_nofile, hard_nofile))
    server = HTTPServer(f"http://127.0.0.1:{port}", proc, stderr_path, api_key)
    try:
        deadline = time.monotonic() + timeout_s
        while SERVING_BANNER not in server.stderr():  # a status line: on stderr
            assert proc.poll() is None, f"the server exited with {proc.returncode}: {server.stderr()}"
            assert time.monotonic() < deadline, f"the server did not start: {server.stderr()}"
            time.sleep(0.05)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
