"""The soak's flatness check at a small scale (benchmarks/soak.py; the full soak is 10 rounds of 10,000 requests and
10 unread rounds of 300 replies of 1 MB, in docs/performance.md): bursts of requests and clients that leave their
replies unread must leave every engine process at the same resident size, round after round."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import MIN_SETTLE_S, Series, soak

ROUNDS = 3
REQUESTS = 1000
UNREAD_REPLIES = 50
REPLY_BYTES = 1_000_000
MAX_GROWTH = 0.05  # the soak's target: from round 2 to the last
# What the frontend and the scheduler may keep per request served (bytes): a per-request entry that is never freed
# (a dict slot, a request id, a tuple of token ids) costs more. The prefix-cache index kept 750 B per request while
# the KV cache was filling (a tuple of Python ints per cached block), 190 B as int32 bytes.
MAX_BYTES_PER_REQUEST = 400


@pytest.fixture(scope="module")
def series(tiny_qwen3: Path) -> dict[str, Series]:
    # New prompts every burst and 8192 KV blocks: the 3,000 requests' prompt blocks all stay cached, as on a fresh
    # server with a large cache, so the prefix-cache index grows by one entry a request.
    return soak(str(tiny_qwen3), rounds=ROUNDS, requests=REQUESTS, unread_rounds=ROUNDS, unread_replies=UNREAD_REPLIES,
                reply_bytes=REPLY_BYTES, max_tokens=4, settle_s=MIN_SETTLE_S, fresh_prompts=True,
                engine_kwargs={"max_model_len": 64, "num_kvcache_blocks": 8192}, out=print)


def test_after_the_second_burst_no_process_grows_more_than_five_percent(series: dict[str, Series]) -> None:
    growth = series["burst"].growth()
    assert set(growth) == {"frontend", "scheduler", "worker-tp0"}
    assert all(g <= MAX_GROWTH for g in growth.values()), growth


@pytest.mark.parametrize("process", ["frontend", "scheduler"])
def test_a_served_request_leaves_at_most_a_few_hundred_bytes_behind(series: dict[str, Series], process: str) -> None:
    first, last = series["burst"].rounds[0][process], series["burst"].rounds[-1][process]
    assert (last - first) / ((ROUNDS - 1) * REQUESTS) <= MAX_BYTES_PER_REQUEST, (first, last)


def test_the_replies_of_a_client_that_left_unread_are_dropped(series: dict[str, Series]) -> None:
    idle = series["idle"].rounds[0]["frontend"]
    for queued, after in zip(series["queued"].rounds, series["unread"].rounds):
        assert queued["frontend"] - idle >= UNREAD_REPLIES * REPLY_BYTES // 2  # the frontend held them ...
        assert after["frontend"] - idle <= 10 << 20  # ... and let them go with the client
    growth = series["unread"].growth()
    assert all(g <= MAX_GROWTH for g in growth.values()), growth
