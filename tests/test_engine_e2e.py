"""The engine as users meet it: bad input, serving, the client, the CLI, shutdown and process death."""

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

import numpy as np
import pytest
import zmq

from common import ipc
from common.config import ConfigError
from common.ipc import free_port
from common.protocol import ErrorReply, GenerateRequest, Submit, decode, encode
from deltaserve import LLM, EngineClient, SamplingParams
from frontend.launcher import EngineDeadError, EngineStartError
from tests.conftest import REPO, synthetic_prompt
from tests.test_engine_vs_hf import hf_greedy

GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):
    engine = LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=256, num_kvcache_blocks=32)
    yield engine
    engine.shutdown()


# ----------------------------------------------------------------------------- bad input, one request at a time
def submit_and_wait(llm: LLM, requests: list[GenerateRequest], all_or_nothing: bool = False,
                    **client_kwargs: object) -> dict:
    """Send `requests` in one Submit from a fresh client, as a client that skips `LLM`'s own checks
    would; wait until all finish; request id -> its final output."""
    client = EngineClient(llm.engine.endpoints.client, **client_kwargs)
    try:
        ipc.send(client.sock, Submit(requests, all_or_nothing=all_or_nothing))
        outs = {}
        while len(outs) < len(requests):
            outs.update({o.request_id: o for o in client.recv_outputs(timeout_s=30) if o.finished})
        return outs
    finally:
        client.close()


def test_a_cpu_engine_watches_its_steps_with_the_cpu_default_timeout(llm: LLM) -> None:
    assert llm.info["devices"] == ["cpu"]
    assert llm.info["step_timeout_s"] == 3600.0


def test_empty_prompt_fails_alone_and_the_others_are_served(llm: LLM, tiny_qwen3: Path) -> None:
    outs = llm.generate(["hello", "", "world"], GREEDY8, use_tqdm=False)
    assert outs[1]["finish_reason"] == "error" and "empty" in outs[1]["error"]
    hello = llm.tokenizer("hello")["input_ids"]
    assert outs[0]["token_ids"] == hf_greedy(str(tiny_qwen3), tuple(hello))[:8]
    assert outs[2]["error"] is None and len(outs[2]["token_ids"]) == 8
    empty_ids = llm.generate([[]], GREEDY8, use_tqdm=False)[0]
    assert "empty" in empty_ids["error"]
    again = llm.generate(["hello"], GREEDY8, use_tqdm=False)
    assert len(again) == 1 and again[0]["token_ids"] == outs[0]["token_ids"]


def test_prompt_at_or_over_max_model_len_is_rejected_naming_both_lengths(llm: LLM) -> None:
    for n in (256, 300):
        out = llm.generate([synthetic_prompt(n, 1)], GREEDY8, use_tqdm=False)[0]
        assert out["finish_reason"] == "error"
        assert f"{n} tokens" in out["error"] and "max_model_len is 256" in out["error"]


def test_prompt_needing_more_blocks_than_the_cache_is_rejected_naming_the_blocks(tiny_qwen3: Path,
                                                                                 engine_factory) -> None:
    small = engine_factory(tiny_qwen3, block_size=16, max_model_len=1024, num_kvcache_blocks=4)
    outs = small.generate([synthetic_prompt(6, 1), synthetic_prompt(94, 2), synthetic_prompt(6, 3)], GREEDY8,
                          use_tqdm=False)
    assert outs[1]["finish_reason"] == "error"
    assert "needs 6 KV-cache blocks" in outs[1]["error"] and "only 4 blocks" in outs[1]["error"]
    assert [len(outs[i]["token_ids"]) for i in (0, 2)] == [8, 8]


def test_out_of_vocabulary_token_ids_are_rejected(llm: LLM) -> None:
    out = llm.generate([[1, 2, 10**9]], GREEDY8, use_tqdm=False)[0]
    assert out["finish_reason"] == "error" and "[0, 151669)" in out["error"]
    out = llm.generate([[5, -1]], GREEDY8, use_tqdm=False)[0]
    assert out["finish_reason"] == "error"


def test_invalid_sampling_parameters_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    # The same values sent over the wire by a client that skips validation: an error for that request.
    outs = submit_and_wait(llm, [GenerateRequest("a", prompt="hi", sampling={"max_tokens": -3}),
                                 GenerateRequest("b", prompt="hi", sampling={"temperature": -1.0}),
                                 GenerateRequest("c", prompt="hi", sampling={"tempurature": 1.0}),
                                 GenerateRequest("d", prompt="hi", prompt_token_ids=[1, 2]),
                                 GenerateRequest("e", prompt="hi", sampling={"max_tokens": 2, "temperature": 0.0})])
    assert "max_tokens" in outs["a"].error
    assert "temperature" in outs["b"].error
    assert "tempurature" in outs["c"].error
    assert "exactly one of" in outs["d"].error
    assert outs["e"].error is None and len(outs["e"].token_ids) >= 1


def test_inputs_that_used_to_crash_the_frontend_fail_alone(llm: LLM) -> None:
    """A token id past 64 bits, messages the chat template raises on, and a text longer than
    max_model_len tokens could ever hold (refused before tokenizing): errors for those requests only."""
    outs = submit_and_wait(llm, [GenerateRequest("a", prompt_token_ids=[5, 2**63]),
                                 GenerateRequest("b", messages=[{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "x",
                                                                 "tool_calls": 5}]),
                                 GenerateRequest("c", prompt="hello " * 20_000),
                                 GenerateRequest("d", prompt="hi", sampling={"max_tokens": 2, "temperature": 0.0})])
    assert outs["a"].error == f"prompt token ids must be in [0, 151669); got min 5, max {2**63}"
    assert "chat template" in outs["b"].error
    assert "characters" in outs["c"].error
    assert outs["d"].error is None and len(outs["d"].token_ids) == 2
    assert llm.generate(["still serving"], GREEDY8, use_tqdm=False)[0]["finish_reason"] == "length"


def test_inputs_that_cannot_be_sent_fail_alone_and_the_others_run(llm: LLM) -> None:
    """A token id past 64 bits or a text with a lone surrogate cannot be encoded at all: that request fails
    with an error naming the field, as an engine rejection would, and the others in the same call run."""
    outs = llm.generate([[1, 2**70], "Hello", "\ud800 lone", [5, 6]], GREEDY8, use_tqdm=False)
    assert outs[0]["finish_reason"] == "error"
    assert f"prompt_token_ids[1] is {2**70}, which does not fit in 64 bits" in outs[0]["error"]
    assert outs[2]["finish_reason"] == "error" and "prompt is not valid Unicode" in outs[2]["error"]
    assert "lone surrogate '\\ud800' at index 0" in outs[2]["error"]
    assert outs[1]["error"] is None and len(outs[1]["token_ids"]) == 8
    assert outs[3]["error"] is None and len(outs[3]["token_ids"]) == 8


def test_sampling_parameters_out_of_range_fail_their_own_request_only(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"max_tokens must be an integer in \[1, 2\*\*63\)"):
        SamplingParams(max_tokens=2**70)
    with pytest.raises(ValueError, match=r"stop_token_ids must be a list of integers in \[0, 2\*\*63\)"):
        SamplingParams(stop_token_ids=[2**70])
    too_long, bad_stop = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8)
    too_long.max_tokens, bad_stop.stop_token_ids = 2**70, [2**70]  # changed after the checks at construction
    outs = llm.generate(["a", "b", "c"], [too_long, GREEDY8, bad_stop], use_tqdm=False)
    assert outs[0]["finish_reason"] == "error" and "max_tokens" in outs[0]["error"]
    assert outs[2]["finish_reason"] == "error" and "stop_token_ids" in outs[2]["error"]
    assert outs[1]["error"] is None and len(outs[1]["token_ids"]) == 8


def test_the_client_class_fails_unsendable_requests_alone(llm: LLM) -> None:
    client = EngineClient(llm.engine.endpoints.client)
    try:
        for prompt, field in [([1, 2**70], "prompt_token_ids[1]"), ("\ud800", "prompt"),
                              ([{"role": "user", "content": "hi \udfff"}], "messages[0]['content']")]:
            outs = list(client.generate(prompt, GREEDY8))
            assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "error"
            assert outs[0].error.startswith(f"this request cannot be sent: {field} ")
        assert len(list(client.generate([5, 6], GREEDY8, stream=False))[-1].token_ids) == 8
    finally:
        client.close()


def test_bytes_are_refused_as_a_prompt_not_taken_for_token_ids(llm: LLM) -> None:
    for prompts in (b"hello", [b"hello"], ["fine", bytearray(b"hi")]):
        with pytest.raises(TypeError, match="decode it to str first"):
            llm.generate(prompts, GREEDY8, use_tqdm=False)
    client = EngineClient(llm.engine.endpoints.client)
    try:
        with pytest.raises(TypeError, match="not bytes"):
            next(client.generate(b"hello", GREEDY8))
    finally:
        client.close()


def test_numpy_integers_are_taken_wherever_python_ints_are(llm: LLM) -> None:
    params = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int32(6), seed=np.int64(7), ignore_eos=True,
                            stop_token_ids=np.array([3], dtype=np.int64))
    assert (type(params.max_tokens), type(params.seed), params.stop_token_ids) == (int, int, [3])
    prompt = [5, 6, 7, 8]
    outs = llm.generate([np.array(prompt), np.array(prompt, dtype=np.uint32), [np.int64(t) for t in prompt]], params,
                        use_tqdm=False)
    assert all(o["error"] is None for o in outs)
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"] and len(outs[0]["token_ids"]) == 6


def test_an_all_or_nothing_submission_with_one_bad_request_runs_none(llm: LLM) -> None:
    outs = submit_and_wait(llm, [GenerateRequest("good", prompt="hi", sampling={"max_tokens": 2}),
                                 GenerateRequest("bad", prompt="")], all_or_nothing=True)
    assert outs["bad"].finish_reason == outs["good"].finish_reason == "error"
    assert "all-or-nothing" in outs["good"].error and not outs["good"].token_ids


def test_two_generate_iterators_of_one_client_can_be_read_in_turn(llm: LLM) -> None:
    client = EngineClient(llm.engine.endpoints.client)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        g1, g2 = client.generate("a", sp, stream=True), client.generate("b", sp, stream=True)
        first1, first2 = next(g1), next(g2)
        rest1 = list(g1)  # used to wait forever: g2 held g1's outputs
        rest2 = list(g2)
        assert sum(len(o.token_ids) for o in [first1, *rest1]) == 6
        assert sum(len(o.token_ids) for o in [first2, *rest2]) == 6
    finally:
        client.close()


def test_a_frontend_busy_with_a_long_submission_is_not_taken_for_dead(llm: LLM) -> None:
    """8,000 texts (each too long for max_model_len 256, so rejected after tokenizing) keep the frontend busy
    for seconds; keep-alive Pongs stop a client with a 1.5 s silence limit from giving up."""
    text = "lorem ipsum dolor sit amet " * 120
    t0 = time.monotonic()
    outs = submit_and_wait(llm, [GenerateRequest(str(i), prompt=f"{i} {text}") for i in range(8000)],
                           dead_after_s=1.5)
    assert time.monotonic() - t0 > 1.5, "the submission was too quick to test anything"
    assert len(outs) == 8000 and all("max_model_len" in o.error for o in outs.values())


def test_a_folder_without_tokenizer_files_is_refused(tiny_qwen3: Path, tmp_path: Path) -> None:
    from frontend.process import load_tokenizer

    (tmp_path / "config.json").write_text((tiny_qwen3 / "config.json").read_text())
    with pytest.raises(RuntimeError, match="tokenizer"):
        load_tokenizer(str(tmp_path))


def test_a_config_json_smaller_than_the_weights_is_refused_at_load(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The embedding's loader takes the rows it needs, so a vocab_size below the checkpoint's rows used to
    load a truncated model without a word."""
    for item in tiny_qwen3.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 151000}))
    with pytest.raises(EngineStartError, match=r"checkpoint tensor model.embed_tokens.weight in model.safetensors "
                                               r"has shape \[151669, 64\], but .*config.json implies \[151000, 64\]"):
        LLM(str(tmp_path), device="cpu", max_model_len=256)


def test_unknown_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path / "empty"))
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tmp_path / "nope"), "--prompt", "hi"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "does not exist" in result.stderr


def test_malformed_messages_get_an_error_reply_and_serving_continues(llm: LLM) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(llm.engine.endpoints.client)
    try:
        for garbage in (b"\xc1\xc1garbage", encode(ErrorReply("clients may not send this")),
                        b"\x93\x63\xa6Submit\x90",  # protocol version 99
                        b"\x92\x01\xa6Submit"):  # Submit without its requests
            sock.send(garbage)
            assert sock.poll(10_000), "no reply to a malformed message"
            reply = decode(sock.recv())
            assert isinstance(reply, ErrorReply), reply
        for frames in ([b"a", b"b"], [b"a", b"b", b"c"]):  # a message is one frame
            sock.send_multipart(frames)
            assert sock.poll(10_000), f"no reply to a message of {len(frames)} frames"
            reply = decode(sock.recv())
            assert isinstance(reply, ErrorReply) and f"one frame, not {len(frames)}" in reply.error, reply
    finally:
        sock.close()
    assert len(llm.generate(["still serving"], GREEDY8, use_tqdm=False)[0]["token_ids"]) == 8


def test_streamed_deltas_add_up_to_the_non_streamed_text(llm: LLM) -> None:
    client = EngineClient(llm.engine.endpoints.client)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        deltas = list(client.generate("价格 是 100元 👍🏽", params, stream=True))
        whole = list(client.generate("价格 是 100元 👍🏽", params, stream=False))
    finally:
        client.close()
    assert len(whole) == 1 and whole[0].finished
    assert "".join(d.text for d in deltas) == whole[0].text
    assert sum((d.token_ids for d in deltas), []) == whole[0].token_ids
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])


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


def _serve(model: Path, port: int, run_root: Path,
           stderr: int = subprocess.PIPE) -> tuple[subprocess.Popen, list[int], Path]:
    """`launch.py --serve` of `model` on CPU, its temporary folder `run_root`, once it says it serves:
    (the launcher, its child processes, its socket folder)."""
    server = subprocess.Popen([sys.executable, "launch.py", "--model", str(model), "--serve", "--port", str(port),
                               "--device", "cpu", "--max-model-len", "256"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=stderr, text=True, env={**os.environ, "TMPDIR": str(run_root)})
    line = server.stdout.readline()
    assert "serving" in line, line + (server.stderr.read() if server.stderr else "")
    (run_dir,) = run_root.glob("deltaserve-*")
    return server, _children(server.pid), run_dir


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_the_client_cli_and_stops_cleanly(tiny_qwen3: Path, run_root: Path, stop_signal: int) -> None:
    port = free_port()
    server, children, run_dir = _serve(tiny_qwen3, port, run_root)
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
    finally:
        t0 = time.monotonic()
        server.send_signal(stop_signal)
        code = server.wait(timeout=30)
    assert time.monotonic() - t0 < 15
    assert code in (0, 128 + stop_signal)  # 130 for Ctrl-C, 143 for SIGTERM, as shells report them
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children), "engine processes outlived the launcher"
    assert not run_dir.exists(), "socket folder left behind"
    with socket.socket() as s:  # the client port is free again
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(("stop_signal", "how"), [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_a_client_of_a_server_stopped_by_its_operator_is_told_so(
        tiny_qwen3: Path, run_root: Path, stop_signal: int, how: str) -> None:
    port = free_port()
    server, _, _ = _serve(tiny_qwen3, port, run_root)
    client = EngineClient(f"tcp://127.0.0.1:{port}", dead_after_s=8)
    try:
        outputs = client.generate("Tell me a story", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        next(outputs)  # it is running
        server.send_signal(stop_signal)
        out = list(outputs)[-1]
    finally:
        client.close()
        code = server.wait(timeout=30)
    assert code == 128 + stop_signal
    assert out.finish_reason == "error"
    assert out.error == f"the engine is shutting down: the server was stopped ({how})", out.error


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


def test_client_cli_json_prints_one_object_per_prompt_failed_ones_included(llm: LLM, capsys) -> None:
    from frontend.client import main

    code = main(["--address", llm.engine.endpoints.client, "--json", "--max-tokens", "2", "one", "", "two"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1  # a prompt failed
    assert sorted(r["prompt"] for r in rows) == ["", "one", "two"]
    failed = next(r for r in rows if r["prompt"] == "")
    assert failed["finish_reason"] == "error" and "empty" in failed["error"]
    assert all(r["error"] is None and len(r["token_ids"]) == 2 for r in rows if r["prompt"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--timeout", "0", "hi"], "--timeout must be a number of seconds > 0, got 0.0"),
    (["--timeout", "-5", "hi"], "--timeout must be a number of seconds > 0, got -5.0"),
    (["--timeout", "nan", "hi"], "--timeout must be a number of seconds > 0, got nan"),
    (["--address", "garbage", "hi"], "cannot connect to the engine address 'garbage': Invalid argument"),
    (["--address", "http://x", "hi"], "cannot connect to the engine address 'http://x': Protocol not supported"),
])
def test_client_cli_refuses_bad_arguments_by_name(argv: list[str], message: str, capsys) -> None:
    from frontend.client import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err
    assert err.startswith("python -m frontend.client: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("module", ["frontend", "scheduler_proc", "workers"])
def test_engine_process_usage_names_the_real_command(module: str, capsys) -> None:
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"{module}.process").main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith(f"usage: python -m {module} "), out


def test_client_reports_an_engine_that_is_not_there() -> None:
    result = subprocess.run([sys.executable, "-m", "frontend.client", "--port", str(free_port()), "--timeout", "2",
                             "hi"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no answer from the engine" in result.stderr


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


def test_help_documents_every_engine_flag() -> None:
    result = subprocess.run([sys.executable, "launch.py", "--help"], cwd=REPO, capture_output=True, text=True)
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--num-kvcache-blocks", "--gpu-memory-utilization", "--enforce-eager", "--dtype", "--device",
                 "--seed", "--tp", "--attention-backend", "--serve", "--json", "--chat", "--prompt"):
        assert flag in result.stdout


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
    server, children, run_dir = _serve(tiny_qwen3, free_port(), run_root, stderr=subprocess.DEVNULL)
    server.kill()
    server.wait()
    deadline = time.monotonic() + 10
    while (any(_alive(c) for c in children) or run_dir.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children)
    assert not run_dir.exists()
