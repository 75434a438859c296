"""AsyncEngineClient against a stand-in frontend (a ROUTER socket in a thread): many concurrent requests on
one socket, aborts, unsendable requests, and a frontend that falls silent."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from common.protocol import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    Abort,
    EngineInfo,
    GenerateRequest,
    GetEngineInfo,
    Ping,
    Pong,
    RequestOutput,
    RequestOutputs,
    Submit,
    decode,
    encode,
)
from frontend.async_client import AsyncEngineClient, EngineUnavailable


@dataclass
class FakeFrontend:
    """Answers GetEngineInfo and Ping; finishes each submitted request at once with its prompt as its text,
    unless `hold` (then the request stays open); records aborts. `silent`: answers nothing at all."""

    address: str
    hold: bool = False
    silent: bool = False
    aborted: list[str] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
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
