"""launch.py refuses what it can see is wrong before it starts any process or loads a model."""

from __future__ import annotations

import os
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
    (dict(kv_cache_memory_gb=1e-6), r"one KV block \(16 tokens, 8 KiB\) is larger than the CPU KV-cache budget of "
                                    r"1.05 KiB: lower --block-size or raise --kv-cache-memory-gb"),
])
def test_a_cpu_kv_cache_that_cannot_be_had_is_refused_with_the_option_to_change(
        tiny_qwen3: Path, options: dict, message: str) -> None:
    with pytest.raises(EngineStartError, match=message):
        LLM(str(tiny_qwen3), device="cpu", **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
@pytest.mark.parametrize(("options", "message"), [
    (["--device", "cuda"], "--device 'cuda' was requested but CUDA is not available on this host"),
    (["--attention-backend", "triton"], "the triton attention backend needs a CUDA device"),
    (["--device", "cpu", "--attention-backend", "flash-attn"], "the flash-attn attention backend needs a CUDA device"),
])
def test_a_device_this_host_lacks_is_refused_before_anything_starts(
        tiny_qwen3: Path, options: list[str], message: str) -> None:
    """Found by a fresh user's trial: these were refused by the worker, after 13-20 s of starting processes."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tiny_qwen3), *options, "--prompt", "hi"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr, result.stderr
    assert f"launch.py: error: {message}" in result.stderr, result.stderr


@pytest.mark.parametrize(("options", "message"), [
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


@pytest.mark.parametrize("delay_s", [0.1, 0.5, 1.5, 3.0])  # 0.1: still importing (numpy, ctypes, ...)
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
    if launcher.returncode == 1 and stderr.strip() == "KeyboardInterrupt":  # a loaded machine: Python's own start-up
        pytest.skip(f"interrupted within {delay_s} s, before launch.py's first line ran")
    assert launcher.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr


UNRESOLVABLE = "nosuchhost.invalid"  # RFC 2606: the .invalid top-level domain never resolves


def test_an_unresolvable_host_is_named_as_such_before_anything_starts(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")
    result = subprocess.run([sys.executable, "launch.py", "--model", model, "--serve", "--host", UNRESOLVABLE],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"launch.py: error: cannot resolve --host '{UNRESOLVABLE}': "), result.stderr
    assert result.stderr.count("\n") == 1 and "--port" not in result.stderr, result.stderr


def test_a_prompt_argument_that_is_not_utf8_is_refused_before_the_engine_starts(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")  # no weights: an engine that started would fail in its worker
    result = subprocess.run([sys.executable, "launch.py", "--model", model, "--prompt", "fine", "--prompt", b"caf\xe9"],
                            cwd=REPO, capture_output=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (b"launch.py: error: --prompt 2 is not UTF-8 text: byte 0xe9 at character 3 cannot be "
                             b"decoded: give prompts in UTF-8 (see --help)\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["--temperature", "nan"], "--temperature must be a finite number in [0, 3.4e38]"),
    (["--max-tokens", "0"], "--max-tokens must be an integer in [1, 2**63), got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
    (["--tp", "0"], "--tp must be a positive integer, got 0"),
    (["--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's max_position_embeddings 64"),
    (["--port", "0", "--serve"], "--port must be in 1..65535, got 0"),
    (["--serve", "--http-port", "8123", "--timeout-keep-alive", "0"],
     "--timeout-keep-alive must be at least 1 (seconds), got 0"),
    (["--serve", "--timeout-keep-alive", "70"], "--timeout-keep-alive needs --http-port"),
    (["--serve", "--http-port", "8123", "--timeout-header", "0"],
     "--timeout-header must be a number of seconds in (0, 3600], got 0"),
    (["--serve", "--http-port", "8123", "--timeout-header", "nan"],
     "--timeout-header must be a number of seconds in (0, 3600], got nan"),
    (["--serve", "--http-port", "8123", "--timeout-header", "inf"],
     "--timeout-header must be a number of seconds in (0, 3600], got inf"),
    (["--serve", "--timeout-header", "5"], "--timeout-header needs --http-port"),
    (["--serve", "--tool-call-parser", "hermes"], "--tool-call-parser needs --http-port"),
    (["--serve", "--http-port", "8123", "--enable-auto-tool-choice"],
     "--enable-auto-tool-choice needs --tool-call-parser NAME"),
    (["--serve", "--http-port", "8123", "--tool-call-parser", "mistral"],
     "argument --tool-call-parser: invalid choice: 'mistral'"),
    (["--reasoning-parser", "granite"], "argument --reasoning-parser: invalid choice: 'granite'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_option_is_one_line_naming_the_option_and_pointing_to_help(
        tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from launch import main

    model = write_checkpoint(tmp_path / "m", max_position_embeddings=64)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", model, *(argv if "--serve" in argv else [*argv, "--prompt", "hi"])])

    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f": error: {message}" in err and err.endswith(" (see --help)\n") and err.count("\n") == 1, err


def test_help_names_every_supported_architecture_and_what_enforce_eager_turns_off() -> None:
    from launch import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "Qwen3, Llama or Mistral" in text
    assert "--enforce-eager never use CUDA graphs nor torch.compile" in text



@pytest.mark.parametrize("damage", ["missing", "truncated", "not safetensors"])
def test_missing_or_corrupt_weights_are_one_line_naming_the_file(
        tiny_qwen3: Path, tmp_path: Path, damage: str) -> None:
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_qwen3, model)
    weights = model / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        weights.write_bytes(b"<html>404 Not Found</html>")
    result = subprocess.run([sys.executable, "launch.py", "--model", str(model), "--device", "cpu", "--prompt", "hi"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()  # no worker traceback, and the message said once
    expected = (f"no \\*.safetensors file in {model}: the checkpoint's weights are missing" if damage == "missing"
                else f"cannot read the checkpoint file {weights}: .* \\(a truncated or corrupt download\\?\\)")
    assert re.fullmatch(f"error: worker-tp0: {expected}; the engine was shut down", line), line


def test_a_bad_environment_variable_is_one_line_pointing_to_the_docs_not_to_help(tiny_qwen3: Path) -> None:
    """--help lists options, not environment variables: a bad DELTASERVE_* value points at docs/configuration.md."""
    env = {**os.environ, "DELTASERVE_GEMV_MAX_BATCH": "abc"}
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--prompt", "hi"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert result.stderr.endswith("error: DELTASERVE_GEMV_MAX_BATCH must be a whole number >= 0 (rows; 0 = off), "
                                  "got 'abc' (docs/configuration.md, Environment variables)\n"), result.stderr
    assert result.stderr.count("\n") == 1


def test_a_bad_environment_variable_points_to_the_docs_section_that_documents_it() -> None:
    from frontend.cli import docs_section

    assert docs_section("DELTASERVE_CLIENT_SILENCE_S") == "docs/configuration.md, Environment variables"
    assert docs_section("DELTASERVE_HTTP_MAX_BODY_MB") == "docs/configuration.md, Environment variables"
    assert docs_section("DELTASERVE_NO_SUCH_VARIABLE") == "docs/configuration.md"


def test_a_ctrl_c_wrapped_by_a_class_body_still_counts_as_a_ctrl_c() -> None:
    """Python 3.11 wraps an exception raised in `__set_name__` (a dataclass being defined while a module imports)
    in a RuntimeError: one run of the test above hit exactly that at 0.1 s and printed a traceback."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_module", REPO / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'info'") from interrupt
    except RuntimeError as wrapped:
        assert launch._interrupted(wrapped)
    assert launch._interrupted(KeyboardInterrupt()) and not launch._interrupted(RuntimeError("a real error"))
    assert not launch._interrupted(None)


# ----------------------------------------------------------------------------- which mode, which stream
class FakeEngine:
    """The part of `EngineProcesses` that launch.py's main uses, with no process behind it: it records what it was
    made with and the stop reason it was left, and serves (or runs) until the interrupt `wait` raises."""

    made: list[FakeEngine] = []

    def __init__(self, config: object, client_address: str | None = None, client_listener: socket.socket | None = None,
                 **kwargs: object) -> None:
        self.config, self.client_address, self.stop_reasons = config, client_address, []
        self.endpoints = self
        self.client = client_address
        if client_listener is not None:
            client_listener.close()
        http = kwargs.get("http")
        if http is not None:
            http.listener.close()
        FakeEngine.made.append(self)

    def start(self) -> dict[str, object]:
        return {"model": "tiny", "num_kv_blocks": 10, "block_size": 16}

    def wait(self) -> None:
        raise KeyboardInterrupt  # Ctrl-C while serving

    def write_stop_reason(self, reason: str) -> None:
        self.stop_reasons.append(reason)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[FakeEngine]:
    """launch.main with `FakeEngine` for its engine and a config-only checkpoint for the demo model."""
    import frontend.default_model
    import frontend.launcher

    FakeEngine.made = []
    monkeypatch.setattr(frontend.launcher, "EngineProcesses", FakeEngine)
    monkeypatch.setattr(frontend.default_model, "ensure_default_model", lambda: write_checkpoint(tmp_path / "demo"))
    return FakeEngine


def test_port_alone_serves_the_demo_model_on_that_zeromq_port(fake_engine: type[FakeEngine],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`launch.py --port P` ran the one-shot demo and exited 0, ignoring the port: --port implies --serve."""
    from common.ipc import free_port
    from launch import main

    port = free_port()
    assert main(["--port", str(port)]) == 130  # served until the Ctrl-C of FakeEngine.wait
    (engine,) = fake_engine.made
    assert engine.client_address == f"tcp://127.0.0.1:{port}"
    assert engine.stop_reasons == ["the server was stopped (Ctrl-C)"]


def test_the_serving_banner_and_every_status_line_go_to_stderr_not_stdout(
        fake_engine: type[FakeEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A script that waits on stderr for the banner never saw it: it alone went to stdout."""
    from common.ipc import free_port
    from launch import main

    port, http_port = free_port(), free_port()
    model = write_checkpoint(tmp_path / "m")
    assert main(["--model", model, "--port", str(port), "--http-port", str(http_port)]) == 130
    out, err = capsys.readouterr()
    assert out == ""
    assert (f"deltaserve: serving tiny ({fake_engine.made[0].config.model}) to the OpenAI API on "
            f"http://127.0.0.1:{http_port}/v1 and ZeroMQ clients on tcp://127.0.0.1:{port}") in err
    assert "deltaserve: stopping" in err


def test_ctrl_c_of_a_one_shot_run_says_the_run_was_interrupted_not_that_a_server_stopped(
        fake_engine: type[FakeEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import launch

    def interrupted(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "run_prompts", interrupted)
    assert launch.main(["--model", write_checkpoint(tmp_path / "m"), "--prompt", "Hi"]) == 130
    assert fake_engine.made[0].stop_reasons == ["the run was interrupted (Ctrl-C)"]
    out, err = capsys.readouterr()
    assert out == "" and "server" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--http-port", "{h}"],
     "--prompt is for one-shot runs, and --http-port serves: start the server without --prompt, then send prompts to "
     "http://127.0.0.1:{h}/v1/completions or /v1/chat/completions (curl, or the openai client with "
     "base_url='http://127.0.0.1:{h}/v1')"),
    (["--http-port", "{h}", "--port", "{p}"],
     "send prompts to http://127.0.0.1:{h}/v1/completions or /v1/chat/completions (curl, or the openai client with "
     "base_url='http://127.0.0.1:{h}/v1'), or with python -m frontend.client --port {p}"),
    (["--port", "{p}"],
     "--prompt is for one-shot runs, and --port serves ZeroMQ clients: start the server without --prompt, then send "
     "prompts with python -m frontend.client --port {p} (or EngineClient), or serve HTTP too with --http-port and send "
     "them to /v1/completions (curl, or the openai client)"),
    (["--serve"], "then send prompts with python -m frontend.client --port 8000 (or EngineClient)"),
])
def test_a_prompt_with_a_serving_flag_is_refused_naming_how_to_send_it_to_the_server(
        tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from common.ipc import free_port
    from launch import main

    ports = {"{h}": str(free_port()), "{p}": str(free_port())}
    for key, port in ports.items():
        argv = [a.replace(key, port) for a in argv]
        message = message.replace(key, port)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", write_checkpoint(tmp_path / "m"), "--prompt", "Hi", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err


def test_help_says_which_port_is_zeromq_and_which_is_http() -> None:
    """A vLLM user reads --port as the HTTP port: the help says it is not."""
    from launch import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--port PORT ZeroMQ client socket port (python -m frontend.client, EngineClient), not HTTP" in text
    assert "--http-port PORT the OpenAI-compatible HTTP API's port (vLLM's --port)" in text


@pytest.mark.parametrize("serving", [["--serve"], ["--http-port", "8000"]])
def test_json_with_a_serving_flag_is_refused_naming_the_client_s_json(
        tmp_path: Path, serving: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--json formats a one-shot run's answers; a server has none to print, so it says where JSON comes from."""
    from launch import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", write_checkpoint(tmp_path / "m"), "--json", *serving])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--json prints the answers of a one-shot run (--prompt)" in err
    assert "python -m frontend.client --json" in err
