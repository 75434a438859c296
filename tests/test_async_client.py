"""AsyncEngineClient against a stand-in frontend (a ROUTER socket in a thread): many concurrent requests on
one socket, aborts, unsendable requests, and a frontend that falls silent."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from common.protocol import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    NOT_RUN,
    Abort,
    EngineInfo,
    GenerateRequest,
    GetEngineInfo,
    Ping,
    Pong,
    PositionLogprobs,
    ProfileStatus,
    RequestOutput,
    RequestOutputs,
    SampleOutput,
    StartProfile,
    StopProfile,
    Submit,
    TopLogprob,
    decode,
    encode,
)
from frontend.async_client import AsyncEngineClient, EngineUnavailable, merge_outputs


@dataclass
class FakeFrontend:
    """Answers GetEngineInfo and Ping; finishes each submitted request at once with its prompt as its text,
    unless `hold` (then the request stays open); records aborts. `silent`: answers nothing at all."""

    address: str
    hold: bool = False
    silent: bool = False
    aborted: list[str] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    profile_requests: list[object] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        while not self.stop.is_set():
            if not sock.poll(20):
                continue
            client, raw = sock.recv_multipart()
            if self.silent:
                continue
            msg = decode(raw)
            if isinstance(msg, GetEngineInfo):
                reply = EngineInfo("fake", 64, 10, 16, 100, served_model_names=["fake"])
            elif isinstance(msg, Ping):
                reply = Pong(msg.nonce)
            elif isinstance(msg, Submit):
                self.submitted += [r.request_id for r in msg.requests]
                if self.hold:
                    continue
                reply = RequestOutputs([RequestOutput(r.request_id, r.prompt or "", [1], True, "stop")
                                        for r in msg.requests])
            elif isinstance(msg, Abort):
                self.aborted += msg.request_ids
                continue
            elif isinstance(msg, (StartProfile, StopProfile)):  # answered in order, session = its number
                self.profile_requests.append(msg)
                n = len(self.profile_requests)
                if isinstance(msg, StartProfile) and msg.num_steps == 99:
                    time.sleep(0.5)  # answered late: its caller has given up by then
                reply = ProfileStatus(n, error=None if isinstance(msg, StartProfile) else "not profiling")
            else:
                continue
            sock.send_multipart([client, encode(reply)])
        sock.close()


@pytest.fixture
def frontend(tmp_path) -> Iterator[FakeFrontend]:
    fake = FakeFrontend(f"ipc://{tmp_path}/client")
    thread = threading.Thread(target=fake.run, daemon=True)
    thread.start()
    yield fake
    fake.stop.set()
    thread.join(5)


async def started(fake: FakeFrontend, **kwargs: float) -> AsyncEngineClient:
    client = AsyncEngineClient(fake.address, **kwargs)
    await client.start()
    await client.engine_info(timeout_s=10)
    return client


def test_hundreds_of_concurrent_requests_on_one_socket_each_get_their_own_output(frontend: FakeFrontend) -> None:
    async def one(client: AsyncEngineClient, i: int) -> str:
        await asyncio.sleep(0.001 * (i % 7))  # sends interleave with the outputs coming back
        (stream,) = client.submit([GenerateRequest(client.new_request_id(), prompt=f"prompt {i}")])
        outs = [out async for out in stream]
        return outs[-1].text

    async def run() -> list[str]:
        client = await started(frontend)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(500))), 20)
        finally:
            await client.close()

    assert asyncio.run(run()) == [f"prompt {i}" for i in range(500)]


def test_closing_an_unfinished_stream_aborts_its_request(frontend: FakeFrontend) -> None:
    frontend.hold = True

    async def run() -> str:
        client = await started(frontend)
        try:
            (stream,) = client.submit([GenerateRequest(client.new_request_id(), prompt="long")])
            stream.close()
            for _ in range(100):
                if frontend.aborted:
                    break
                await asyncio.sleep(0.02)
            return stream.request_id
        finally:
            await client.close()

    rid = asyncio.run(run())
    assert frontend.aborted == [rid]


def test_a_request_that_cannot_be_encoded_fails_alone_and_is_not_sent(frontend: FakeFrontend) -> None:
    async def run() -> list[RequestOutput]:
        client = await started(frontend)
        try:
            good, bad = client.submit([GenerateRequest(client.new_request_id(), prompt="fine"),
                                       GenerateRequest(client.new_request_id(), prompt="lone \ud800")])
            return [await good.next_output(), await bad.next_output()]
        finally:
            await client.close()

    good, bad = asyncio.run(run())
    assert good.text == "fine" and good.error is None
    assert bad.error_type == ERROR_INVALID_REQUEST and "lone surrogate" in bad.error
    assert frontend.submitted == [good.request_id]


def test_all_or_nothing_a_request_that_cannot_be_encoded_sends_none(frontend: FakeFrontend) -> None:
    async def run() -> list[RequestOutput]:
        client = await started(frontend)
        try:
            good, bad = client.submit([GenerateRequest(client.new_request_id(), prompt="fine"),
                                       GenerateRequest(client.new_request_id(), prompt="lone \ud800")],
                                      all_or_nothing=True)
            return [await good.next_output(), await bad.next_output()]
        finally:
            await client.close()

    good, bad = asyncio.run(run())
    assert "lone surrogate" in bad.error and good.error.startswith(NOT_RUN) and bad.request_id in good.error
    assert good.finished and good.error_type == ERROR_INVALID_REQUEST
    assert frontend.submitted == []


def test_a_silent_frontend_ends_open_requests_and_refuses_new_ones(frontend: FakeFrontend) -> None:
    frontend.hold = True

    async def run() -> RequestOutput:
        client = await started(frontend, ping_interval_s=0.1, dead_after_s=0.5)
        try:
            (stream,) = client.submit([GenerateRequest(client.new_request_id(), prompt="waits")])
            frontend.silent = True
            out = await asyncio.wait_for(stream.next_output(), 10)
            with pytest.raises(EngineUnavailable):
                client.submit([GenerateRequest(client.new_request_id(), prompt="too late")])
            return out
        finally:
            await client.close()

    out = asyncio.run(run())
    assert out.finished and out.error_type == ERROR_ENGINE_DOWN and "has not answered" in out.error


def test_a_frontend_that_stalled_and_answers_again_is_served_again(frontend: FakeFrontend) -> None:
    """A stall longer than dead_after_s fails the requests that were open (their answers may never come), but a
    frontend heard from again serves new requests: the HTTP server answered 503 for good after a 20 s stall of
    a live engine (a fresh user's trial)."""

    async def run() -> tuple[RequestOutput, RequestOutput]:
        client = await started(frontend, ping_interval_s=0.1, dead_after_s=0.5)
        try:
            frontend.hold = True
            (stream,) = client.submit([GenerateRequest(client.new_request_id(), prompt="waits")])
            frontend.silent = True
            failed = await asyncio.wait_for(stream.next_output(), 10)
            assert not client.serving
            frontend.silent = frontend.hold = False
            for _ in range(100):  # the next pong lifts it
                if client.serving:
                    break
                await asyncio.sleep(0.05)
            (again,) = client.submit([GenerateRequest(client.new_request_id(), prompt="served")])
            return failed, await asyncio.wait_for(again.next_output(), 10)
        finally:
            await client.close()

    failed, served = asyncio.run(run())
    assert failed.error_type == ERROR_ENGINE_DOWN and "has not answered" in failed.error
    assert served.finished and served.error is None and served.text == "served"


def lp(token_id: int) -> PositionLogprobs:
    return PositionLogprobs(token_id, -1.0, 1, f"t{token_id}", [TopLogprob(token_id, -1.0, f"t{token_id}")])


def test_merged_deltas_keep_each_samples_text_tokens_logprobs_and_the_prompt_logprobs() -> None:
    prompt = [None, lp(9)]
    deltas = [
        RequestOutput("r", "a", [1], logprobs=[lp(1)], cumulative_logprob=-1.0, prompt_logprobs=prompt, index=0,
                      samples=[SampleOutput(1, "x", [5], logprobs=[lp(5)], cumulative_logprob=-1.0)],
                      num_prompt_tokens=3),
        RequestOutput("r", "y", [6], logprobs=[lp(6)], cumulative_logprob=-2.0, index=1, num_prompt_tokens=3),
        RequestOutput("r", "b", [2], True, "stop", stop_reason="b", logprobs=[lp(2)], cumulative_logprob=-2.0,
                      index=0, samples=[SampleOutput(1, "", [], "length", logprobs=[], cumulative_logprob=-2.0)],
                      num_prompt_tokens=3, metrics={"e2e_s": 1.0}),
    ]
    out = merge_outputs(deltas)
    first, second = out.outputs
    assert (first.index, first.text, first.token_ids, first.finish_reason, first.stop_reason) == (0, "ab", [1, 2],
                                                                                                  "stop", "b")
    assert [p.token_id for p in first.logprobs] == [1, 2] and first.cumulative_logprob == -2.0
    assert (second.index, second.text, second.token_ids, second.finish_reason) == (1, "xy", [5, 6], "length")
    assert [p.token_id for p in second.logprobs] == [5, 6]
    assert out.prompt_logprobs == prompt
    assert out.finished and out.metrics == {"e2e_s": 1.0} and out.num_prompt_tokens == 3


def test_merged_deltas_of_a_failed_request_keep_its_error_type() -> None:
    out = merge_outputs([RequestOutput("r", "a", [1]), RequestOutput("r", finished=True, finish_reason="error",
                                                                     error="down", error_type=ERROR_ENGINE_DOWN)])
    assert (out.text, out.finish_reason, out.error, out.error_type) == ("a", "error", "down", ERROR_ENGINE_DOWN)


def test_profiling_answers_pair_with_their_requests_in_order_even_after_one_gave_up(frontend: FakeFrontend) -> None:
    async def run() -> tuple[ProfileStatus, ProfileStatus]:
        client = await started(frontend)
        try:
            with pytest.raises(TimeoutError):
                await client.start_profile(num_steps=99, timeout_s=0.2)
            started_status = await asyncio.wait_for(client.start_profile(5), 10)
            stopped = await asyncio.wait_for(client.stop_profile(), 10)
            return started_status, stopped
        finally:
            await client.close()

    started_status, stopped = asyncio.run(run())
    assert [type(m).__name__ for m in frontend.profile_requests] == ["StartProfile", "StartProfile", "StopProfile"]
    assert frontend.profile_requests[1].num_steps == 5
    # The late first answer went to the request that gave up, not to the next one.
    assert (started_status.session, started_status.error) == (2, None)
    assert (stopped.session, stopped.error) == (3, "not profiling")


def test_a_silent_frontend_fails_a_waiting_profiling_request(frontend: FakeFrontend) -> None:
    async def run() -> None:
        client = await started(frontend, ping_interval_s=0.1, dead_after_s=0.5)
        try:
            frontend.silent = True
            with pytest.raises(EngineUnavailable, match="has not answered"):
                await asyncio.wait_for(client.stop_profile(), 10)
        finally:
            await client.close()

    asyncio.run(run())
