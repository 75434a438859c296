"""Limits on what one client can make the engine hold or say: message size, queued requests, and how much of
its input comes back in an error or goes to the log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from common.config import ConfigError, EngineConfig
from common.ipc import free_port
from common.protocol import (
    ERROR_OVERLOADED,
    PROTOCOL_VERSION,
    ErrorReply,
    GenerateRequest,
    RequestOutputs,
    Submit,
    decode,
    encode,
)
from deltaserve import LLM, EngineClient, SamplingParams
from tests.conftest import REPO, synthetic_prompt, wait_until_serving

GREEDY4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LIMIT = 64 << 10  # 64 KiB, the least allowed
MIB = 1 << 20


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):
    engine = LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=512, max_message_bytes=LIMIT)
    yield engine
    engine.shutdown()


def _raw_client(llm: LLM) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(llm.engine.endpoints.client)
    return sock


def _reply(sock: zmq.Socket, timeout_ms: int = 10_000) -> object:
    assert sock.poll(timeout_ms), "no reply"
    return decode(sock.recv())


def test_a_message_over_max_message_bytes_is_dropped_unread_and_others_are_served(llm: LLM) -> None:
    """It used to be read whole into memory and answered. Now its sender is disconnected before the frame
    is read, and gets no answer; the limit is in the engine's info."""
    sock = _raw_client(llm)
    try:
        sock.send(b"\x00" * (LIMIT + 1))
        assert not sock.poll(2000), "a message over the limit was answered"
    finally:
        sock.close()
    client = EngineClient(llm.engine.endpoints.client)
    try:
        assert client.engine_info().info["max_message_bytes"] == LIMIT
    finally:
        client.close()
    assert len(llm.generate(["still serving"], GREEDY4, use_tqdm=False)[0]["token_ids"]) == 4


def test_the_client_splits_a_submission_over_the_limit_and_fails_a_request_over_it_alone(llm: LLM) -> None:
    prompts = [synthetic_prompt(300, seed) for seed in range(100)]  # ~0.9 KiB each: 88 KiB in all, over 64 KiB
    outs = llm.generate(prompts + [list(range(1000, 31_000))], GREEDY4, use_tqdm=False)  # 90 KiB alone
    assert all(o["error"] is None and len(o["token_ids"]) == 4 for o in outs[:-1])
    assert outs[-1]["finish_reason"] == "error"
    assert f"more than the engine's max_message_bytes ({LIMIT})" in outs[-1]["error"], outs[-1]["error"]


def test_the_http_server_s_client_refuses_a_request_over_the_limit_alone_and_keeps_its_other_streams(
        llm: LLM) -> None:
    """The HTTP server's AsyncEngineClient sent any request as it was: one past max_message_bytes made the
    frontend drop that client's whole connection, so the request hung and every other open stream of the server
    stalled. Now that request alone fails at once, a submission over the limit goes in several messages, and an
    all-or-nothing one over it is refused whole."""
    import asyncio

    from common.protocol import NOT_RUN
    from frontend.async_client import AsyncEngineClient

    def request(rid: str, prompt: list[int], max_tokens: int = 4) -> GenerateRequest:
        return GenerateRequest(rid, prompt_token_ids=prompt, sampling={"temperature": 0.0, "max_tokens": max_tokens,
                                                                      "ignore_eos": True})

    async def finished(stream) -> object:
        while True:
            out = await asyncio.wait_for(stream.next_output(), 60)
            if out.finished:
                return out

    async def main() -> None:
        client = AsyncEngineClient(llm.engine.endpoints.client)
        await client.start()
        try:
            await client.engine_info(timeout_s=30)
            assert client.max_message_bytes == LIMIT
            [running] = client.submit([request("running", synthetic_prompt(20, 1), max_tokens=64)])
            [huge] = client.submit([request("huge", list(range(1000, 31_000)))])  # ~90 KiB alone
            out = await finished(huge)
            assert out.finish_reason == "error" and f"more than the engine's max_message_bytes ({LIMIT})" in out.error
            many = client.submit([request(f"m{i}", synthetic_prompt(300, i)) for i in range(100)])  # 88 KiB in all
            assert all(o.error is None for o in [await finished(s) for s in many])
            both = client.submit([request("a", synthetic_prompt(300, i)) for i in range(100)], all_or_nothing=True)
            outs = [await finished(s) for s in both]
            assert all(o.error.startswith(NOT_RUN) and "max_message_bytes" in o.error for o in outs), outs[0].error
            out = await finished(running)
            assert out.error is None and len(out.token_ids) == 64
            result = await client.tokenize(request("t", list(range(1000, 31_000))))
            assert result.error and "max_message_bytes" in result.error
        finally:
            await client.close()

    asyncio.run(main())


def test_errors_quote_at_most_a_few_hundred_characters_of_what_the_client_sent(llm: LLM, capfd) -> None:
    """A 16 KiB field came back whole in the error and went whole to the log."""
    huge = "x" * (16 << 10)  # three of them stay under the 64 KiB limit
    sock = _raw_client(llm)
    capfd.readouterr()
    try:
        output = ["r", "", [], False, None, None, 0, 0, {huge: "not a number"}]  # a RequestOutput
        for bad in (msgpack.packb([PROTOCOL_VERSION, huge]), msgpack.packb([huge, "Submit"]),
                    msgpack.packb([PROTOCOL_VERSION, "RequestOutputs", [output]])):
            sock.send(bad)
            reply = _reply(sock)
            assert isinstance(reply, ErrorReply) and len(reply.error) < 1000, len(reply.error)
        requests = [GenerateRequest("a", prompt="hi", sampling={huge: 1.0}),
                    GenerateRequest("b", prompt="hi", sampling={"temperature": huge}),
                    GenerateRequest("c", prompt="hi", sampling={"stop_token_ids": [-1] * 10_000}),
                    GenerateRequest("d", prompt="hi", sampling={"ignore_eos": [huge]}),
                    GenerateRequest("e", prompt="hi", sampling={"max_tokens": 2, "temperature": 0.0})]
        sock.send(encode(Submit(requests)))
        outs: dict[str, object] = {}
        while len(outs) < len(requests):
            msg = _reply(sock)
            if isinstance(msg, RequestOutputs):
                outs.update({o.request_id: o for o in msg.outputs if o.finished})
        for rid in "abcd":
            assert outs[rid].finish_reason == "error" and len(outs[rid].error) < 1000, (rid, outs[rid].error)
        assert "unknown sampling parameters" in outs["a"].error
        assert "temperature" in outs["b"].error and "(16384 characters)" in outs["b"].error
        assert "stop_token_ids" in outs["c"].error and "(10000 items)" in outs["c"].error
        assert outs["e"].error is None
        sock.send(encode(Submit([GenerateRequest("y" * 1000, prompt="hi")])))  # its id would be echoed back
        reply = _reply(sock)
        assert isinstance(reply, ErrorReply) and "request_id has 1000 characters, at most 256" in reply.error
        assert len(reply.error) < 1000
    finally:
        sock.close()
    time.sleep(0.5)
    log = capfd.readouterr().err
    assert all(len(line) < 2000 for line in log.splitlines()), max(map(len, log.splitlines()))


def test_requests_beyond_max_waiting_requests_are_refused_at_once_naming_the_limit(tiny_qwen3: Path,
                                                                                 engine_factory) -> None:
    """With one request running (max_num_seqs 1) and room for two more to wait, a third is refused at once,
    before anything is queued; an all-or-nothing submission that does not fit runs none; once the queue
    drains, requests are taken again."""
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=512, max_num_seqs=1, max_waiting_requests=2)
    client = EngineClient(llm.engine.endpoints.client)
    running = client.generate("a long one", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    try:
        next(running)  # it has its first token: it no longer waits
        sock = _raw_client(llm)
        reqs = [GenerateRequest(f"w{i}", prompt_token_ids=synthetic_prompt(8, i), sampling={"max_tokens": 2})
                for i in range(4)]
        t0 = time.monotonic()
        sock.send(encode(Submit(reqs)))
        refused = _reply(sock).outputs
        assert time.monotonic() - t0 < 5  # at once, not after the long request
        assert [o.request_id for o in refused] == ["w2", "w3"]
        assert all(o.finish_reason == "error" and "overloaded" in o.error and "is 2" in o.error for o in refused)
        assert all(o.error_type == ERROR_OVERLOADED for o in refused)  # an HTTP server answers 503, not 500
        assert "max_waiting_requests" in refused[0].error
        sock.send(encode(Submit([GenerateRequest("all", prompt="x")], all_or_nothing=True)))
        (none,) = _reply(sock).outputs
        assert none.request_id == "all" and "overloaded" in none.error
        running.close()  # aborted: the two waiting ones run
        done = {}
        while len(done) < 2:
            msg = _reply(sock, 30_000)
            done.update({o.request_id: o for o in msg.outputs if o.finished})
        assert sorted(done) == ["w0", "w1"] and all(o.error is None and len(o.token_ids) == 2 for o in done.values())
        sock.close()
    finally:
        running.close()
        client.close()
    out = llm.generate(["room again"], GREEDY4, use_tqdm=False)[0]
    assert out["error"] is None and len(out["token_ids"]) == 4


@pytest.mark.parametrize(("name", "value", "message"), [
    ("max_message_bytes", 1000, "max_message_bytes must be an integer >= 65536"),
    ("max_message_bytes", 2.5e6, "max_message_bytes must be an integer"),
    ("max_waiting_requests", 0, "max_waiting_requests must be a positive integer"),
])
def test_limit_settings_out_of_range_are_refused_by_name(tiny_qwen3: Path, name: str, value: object,
                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model=str(tiny_qwen3), **{name: value})


def test_a_client_of_a_killed_launcher_is_told_the_launcher_is_gone(tiny_qwen3: Path, tmp_path: Path) -> None:
    """It was told that the frontend got SIGTERM (PR_SET_PDEATHSIG's signal), as if someone had stopped it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--serve", "--port", str(port),
                               "--device", "cpu", "--max-model-len", "4096"], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    wait_until_serving(server, drain=True)
    client = EngineClient(f"tcp://127.0.0.1:{port}", dead_after_s=8)
    outputs = client.generate("Tell me a story", SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
    try:
        next(outputs)  # it is running
        os.kill(server.pid, signal.SIGKILL)
        out = list(outputs)[-1]
    finally:
        outputs.close()
        client.close()
        server.wait()
    assert out.finish_reason == "error"
    assert out.error == "the engine is shutting down: the launcher (the engine's parent process) is gone: it was " \
                        "killed or crashed", out.error
