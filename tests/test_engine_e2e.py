"""The engine as users meet it: bad input (one request at a time), the client class and the client CLI's
arguments. Serving, shutdown and process death are in tests/test_engine_lifecycle.py."""

from __future__ import annotations

import json
import subprocess
import sys
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
from frontend.launcher import EngineStartError
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
    """A token id past 64 bits, an assistant message whose tool_calls are not a list (the chat template raised on
    it; now refused naming the field), and a text longer than max_model_len tokens could ever hold (refused before
    tokenizing): errors for those requests only."""
    outs = submit_and_wait(llm, [GenerateRequest("a", prompt_token_ids=[5, 2**63]),
                                 GenerateRequest("b", messages=[{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "x",
                                                                 "tool_calls": 5}]),
                                 GenerateRequest("c", prompt="hello " * 20_000),
                                 GenerateRequest("d", prompt="hi", sampling={"max_tokens": 2, "temperature": 0.0})])
    assert outs["a"].error == f"prompt token ids must be in [0, 151669); got min 5, max {2**63}"
    assert outs["b"].error == "messages[1].tool_calls must be a list of calls, got 5"
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


def test_breaking_out_of_generate_leaves_nothing_of_that_request_for_recv_outputs(llm: LLM) -> None:
    """The aborted request's final output (finish reason "abort") surfaced in the next recv_outputs()."""
    client = EngineClient(llm.engine.endpoints.client)
    try:
        stream = client.generate("Tell me a story", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        first = next(stream)
        stream.close()  # as a `break` out of a for loop does: the request is aborted
        # The frontend answers in order: the abort's final output comes before this request's end.
        (after,) = client.generate("Hi", GREEDY8, stream=False)
        late = client.recv_outputs(timeout_s=1.0)
    finally:
        client.close()
    assert first.request_id != after.request_id and len(after.token_ids) == 8
    assert late == []


@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.add_request("hi", request_id=123), "request_id must be a string or None"),
    (lambda c: c.add_request("hi", stream="yes"), "stream must be True or False"),
    (lambda c: c.abort([1, 2, 3]), "request_ids must be a request id or a list of them"),
    (lambda c: c.abort({"a": 1}), "request_ids must be a request id or a list of them")])
def test_wrong_argument_types_of_the_request_api_raise_at_once(llm: LLM, call, message: str) -> None:
    """They were sent, and the engine's refusal came out of a later, unrelated recv_outputs() as a RuntimeError
    (a fresh user's trial)."""
    client = EngineClient(llm.engine.endpoints.client)
    try:
        with pytest.raises(TypeError, match=message):
            call(client)
        assert client.recv_outputs(timeout_s=0.5) == []
    finally:
        client.close()


def test_recv_outputs_leaves_an_open_generate_iterators_outputs_to_it(llm: LLM) -> None:
    """recv_outputs() called while a generate() stream was open took one of its deltas: the stream's tokens then
    came one short (a fresh user's trial)."""
    client = EngineClient(llm.engine.endpoints.client)
    try:
        stream = client.generate("Tell me a story", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        first = next(stream)
        taken = client.recv_outputs(timeout_s=1.0)
        rest = list(stream)
    finally:
        client.close()
    assert taken == []
    assert sum(len(o.token_ids) for o in [first, *rest]) == 30 and rest[-1].finished


def test_a_client_submits_prompts_and_messages_aborts_and_receives_without_protocol_types(llm: LLM) -> None:
    client = EngineClient(llm.engine.endpoints.client)
    try:
        text = client.add_request("Hello", GREEDY8, request_id="text")
        chat = client.add_request(messages=[{"role": "user", "content": "Hi"}], params=GREEDY8, stream=True)
        ids = client.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
        client.abort(ids)
        finished, deltas = {}, 0
        while len(finished) < 3:
            for out in client.recv_outputs(timeout_s=30):
                deltas += out.request_id == chat
                if out.finished:
                    finished[out.request_id] = out
    finally:
        client.close()
    assert text == "text" and len(finished[text].token_ids) == 8 and finished[text].finish_reason == "length"
    assert deltas == 8  # streamed: one output per token
    assert finished[ids].finish_reason == "abort" and len(finished[ids].token_ids) < 300


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({}, TypeError, "give a prompt or messages"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, TypeError, "give a prompt or messages, not both"),
    ({"prompt": b"a"}, TypeError, "decode it to str first"),
    ({"prompt": "a", "params": {"max_tokens": 4}}, TypeError, "params must be SamplingParams, got dict"),
    ({"messages": "Hi"}, TypeError, "messages must be a list of"),
])
def test_a_request_that_cannot_be_built_is_refused_before_anything_is_sent(
        llm: LLM, kwargs: dict, error: type, message: str) -> None:
    client = EngineClient(llm.engine.endpoints.client)
    try:
        with pytest.raises(error, match=message):
            client.add_request(**kwargs)
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
    from frontend.validation import load_tokenizer

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


# ----------------------------------------------------------------------------- the client CLI
def test_client_cli_json_prints_one_object_per_prompt_failed_ones_included(llm: LLM, capsys) -> None:
    from frontend.client_cli import main

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
    from frontend.client_cli import main

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


def test_help_documents_every_engine_flag() -> None:
    result = subprocess.run([sys.executable, "launch.py", "--help"], cwd=REPO, capture_output=True, text=True)
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--num-kvcache-blocks", "--gpu-memory-utilization", "--enforce-eager", "--dtype", "--device",
                 "--seed", "--tp", "--attention-backend", "--serve", "--json", "--chat", "--prompt"):
        assert flag in result.stdout
