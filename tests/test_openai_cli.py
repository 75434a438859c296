"""launch.py's HTTP flags: refused in one line before anything starts when they cannot work."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.ipc import free_port
from frontend.openai.server import main as http_main
from tests.conftest import REPO
from tests.test_config import write_checkpoint


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_busy_http_port_is_refused_up_front_naming_the_flag(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")  # config only: nothing gets far enough to need weights
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = launch("--model", model, "--http-port", str(port))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"launch.py: error: cannot serve on 127.0.0.1:{port}: Address already in "
                                          f"use (is another engine serving there? choose --http-port)"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--http-port", "0"], "--http-port must be in 1..65535, got 0"),
    (["--http-port", "70000"], "--http-port must be in 1..65535, got 70000"),
    (["--http-port", "{p}", "--port", "{p}"], "--port and --http-port are both {p}: give them different ports"),
    (["--http-port", "{p}", "--api-server-count", "0"], "--api-server-count must be in 1..64, got 0"),
    (["--serve", "--api-server-count", "2"], "--api-server-count needs --http-port"),
    (["--http-port", "{p}", "--api-key", " "], "--api-key must not be empty"),
    (["--http-port", "{p}", "--served-model-name", ""], "--served-model-name must be a non-empty name"),
    (["--http-port", "{p}", "--client-key", "k.key_secret"], "--client-key secures the ZeroMQ client port"),
])
def test_unusable_http_flags_are_refused_naming_them(tmp_path: Path, flags: list[str], message: str) -> None:
    port = str(free_port())
    result = launch("--model", write_checkpoint(tmp_path / "m"), *[f.replace("{p}", port) for f in flags])
    assert result.returncode == 2
    assert message.replace("{p}", port) in result.stderr


def test_help_documents_the_http_flags() -> None:
    out = launch("--help").stdout
    for flag in ("--http-port", "--api-key", "--served-model-name", "--api-server-count", "--host",
                 "--timeout-keep-alive", "--timeout-header"):
        assert flag in out


def test_the_http_process_usage_names_the_real_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        http_main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: python -m frontend.openai ")
    assert "--http-fd" in out


def test_the_http_access_log_goes_to_stderr_with_every_other_status_line() -> None:
    """uvicorn's own configuration writes its access log (--log-level DEBUG) to stdout."""
    from frontend.openai.server import stderr_logging

    handlers = stderr_logging()["handlers"]
    assert {name: h["stream"] for name, h in handlers.items()} == {"default": "ext://sys.stderr",
                                                                   "access": "ext://sys.stderr"}
