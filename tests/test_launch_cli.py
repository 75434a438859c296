"""launch.py refuses what it can see is wrong before it starts any process or loads a model."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltaserve import LLM
from frontend.launcher import EngineStartError
from tests.conftest import REPO
from tests.test_config import write_checkpoint


def test_a_port_another_server_listens_on_is_refused_up_front(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")  # config only: nothing gets far enough to need weights
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "launch.py", "--model", model, "--serve", "--port", str(port)],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in result.stderr


@pytest.mark.parametrize(("options", "message"), [
    (dict(kv_cache_memory_gb=100_000.0), r"does not fit in this host's available memory .* lower --kv-cache-memory-gb"),
    (dict(num_kvcache_blocks=10**9), r"does not fit in this host's available memory"),
    (dict(block_size=2**22, max_model_len=256), r"one KV block .* is larger than the CPU KV-cache budget of 1 GiB"),
])
def test_a_cpu_kv_cache_that_cannot_be_had_is_refused_with_the_option_to_change(
        tiny_qwen3: Path, options: dict, message: str) -> None:
    with pytest.raises(EngineStartError, match=message):
        LLM(str(tiny_qwen3), device="cpu", **options)


@pytest.mark.parametrize(("options", "message"), [
    pytest.param(["--device", "cuda"], "device 'cuda' was requested but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")),
    (["--device", "cpu", "--kv-cache-memory-gb", "100000"], "does not fit in this host's available memory"),
])
def test_an_anticipated_start_failure_is_one_clear_line_not_a_traceback(
        tiny_qwen3: Path, options: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tiny_qwen3), *options, "--prompt", "hi"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    assert re.search(f"error: worker-tp0: .*{re.escape(message)}", result.stderr), result.stderr
    assert "the engine was shut down" in result.stderr, result.stderr


@pytest.mark.parametrize("delay_s", [0.5, 1.5, 3.0])
def test_ctrl_c_while_starting_stops_without_a_traceback(tiny_qwen3: Path, delay_s: float) -> None:
    """Ctrl-C while the launcher reads the model or the engine's processes start: exit 130, no traceback."""
    launcher = subprocess.Popen([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--device", "cpu",
                                 "--prompt", "hi"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                # as from a terminal, also when these tests run in the background (SIGINT ignored)
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay_s)
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=60)
    if launcher.returncode == 0:  # it finished first: nothing to check
        pytest.skip(f"the run was over within {delay_s} s")
    assert launcher.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
