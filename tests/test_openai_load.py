"""Load on the HTTP server, loopback only, bounded in count and time: 200 concurrent streaming chats all end
with [DONE], none lost or duplicated, and the KV cache is empty afterwards; 50 clients that disconnect
mid-stream all have their requests aborted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.openai_server import HTTPServer, http_server

NUM_STREAMS = 200
NUM_LEAVERS = 50
TIME_LIMIT_S = 240


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    with http_server(tiny_qwen3, tmp_path_factory.mktemp("http-load"), "--max-model-len", "256",
                     "--num-kvcache-blocks", "1024") as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


def idle(m: dict[str, float]) -> bool:
    return (m["deltaserve:num_requests_running"] == 0 and m["deltaserve:num_requests_waiting"] == 0
            and m["deltaserve:kv_cache_usage_perc"] == 0)


async def stream_chat(http: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[str, list[dict], bool]:
    """One streamed chat: (its id, its chunks, whether it ended with [DONE])."""
    body = {"messages": [{"role": "user", "content": f"Request number {i}: say something."}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    chunks, done = [], False
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done = True
            else:
                chunks.append(json.loads(line[len("data: "):]))
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1, ids
    return ids.pop(), chunks, done


async def leave_mid_stream(http: httpx.AsyncClient, i: int) -> None:
    """Start a long stream, read until the first text arrives, then hang up."""
    body = {"messages": [{"role": "user", "content": f"Leaver {i}"}], "stream": True, "max_tokens": 200,
            "ignore_eos": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return


def http_client(server: HTTPServer, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=httpx.Timeout(TIME_LIMIT_S),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


def test_200_concurrent_streaming_chats_all_finish_once_and_free_every_block(server: HTTPServer) -> None:
    before = server.wait_metrics(idle)

    async def run() -> list[tuple[str, list[dict], bool]]:
        async with http_client(server, NUM_STREAMS) as http:
            return await asyncio.wait_for(asyncio.gather(*(stream_chat(http, i, 8) for i in range(NUM_STREAMS))),
                                          TIME_LIMIT_S)

    results = asyncio.run(run())

    assert all(done for _, _, done in results)
    assert len({rid for rid, _, _ in results}) == NUM_STREAMS  # no response delivered twice or lost
    for _, chunks, _ in results:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 8
    after = server.wait_metrics(idle)
    assert after["deltaserve:request_success_total{finished_reason=length}"] - before[
        "deltaserve:request_success_total{finished_reason=length}"] == NUM_STREAMS
    assert after["deltaserve:generation_tokens_total"] - before["deltaserve:generation_tokens_total"] == 8 * NUM_STREAMS


def test_50_clients_that_disconnect_mid_stream_are_all_aborted(server: HTTPServer) -> None:
    before = server.wait_metrics(idle)
    key = "deltaserve:request_success_total{finished_reason=abort}"

    async def run() -> None:
        async with http_client(server, NUM_LEAVERS) as http:
            await asyncio.wait_for(asyncio.gather(*(leave_mid_stream(http, i) for i in range(NUM_LEAVERS))),
                                   TIME_LIMIT_S)

    asyncio.run(run())

    after = server.wait_metrics(lambda m: idle(m) and m[key] - before[key] == NUM_LEAVERS, timeout_s=60)
    assert after["deltaserve:request_success_total{finished_reason=length}"] == before[
        "deltaserve:request_success_total{finished_reason=length}"]  # none ran to its 200 tokens
