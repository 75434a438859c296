"""Malformed messages of every type at the client port (hypothesis): the engine answers each with an error or
not at all, never dies, and still serves a normal request exactly (the greedy tokens measured before)."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    EngineInfo,
    EngineStats,
    ErrorReply,
    Pong,
    ProfileStatus,
    RequestOutputs,
    decode,
)
from deltaserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [1000, 2000, 3000, 4000]
# Examples per run: about 15 s here on two busy cores, well inside CI's minute for this test.
EXAMPLES = 1000

ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 151_668, 151_669]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=40),
                    st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.one_of(st.text(max_size=10), ints), inner,
                                                                       max_size=4)), max_leaves=20)
sampling = st.dictionaries(st.sampled_from(["temperature", "max_tokens", "ignore_eos", "stop_token_ids", "seed",
                                            "skip_special_tokens", "top_k", ""]), values, max_size=4)
token_ids = st.lists(st.one_of(st.integers(0, 151_668), ints), max_size=12)
messages = st.lists(st.dictionaries(st.sampled_from(["role", "content", "tool_calls"]),
                                    st.one_of(st.sampled_from(["user", "assistant", "system"]), values)), max_size=3)
# A GenerateRequest's fields in order, each either well typed or anything.
request = st.tuples(st.one_of(st.text(max_size=8), values), st.one_of(st.none(), st.text(max_size=30), values),
                    st.one_of(st.none(), token_ids, values), st.one_of(st.none(), messages, values),
                    st.one_of(sampling, values), st.one_of(st.booleans(), values)).map(list)
submit = st.tuples(st.just(PROTOCOL_VERSION), st.just("Submit"), st.lists(request, max_size=3),
                   st.one_of(st.booleans(), values)).map(list)
any_type = st.tuples(st.one_of(st.just(PROTOCOL_VERSION), values), st.one_of(st.sampled_from(sorted(MESSAGE_TYPES)),
                                                                               values),
                     st.lists(values, max_size=8)).map(lambda t: [t[0], t[1], *t[2]])
frames = st.one_of(
    st.binary(max_size=200).map(lambda b: [b]),  # not msgpack, or truncated msgpack
    values.map(lambda v: [msgpack.packb(v, use_bin_type=True)]),  # msgpack, but not a message
    any_type.map(lambda v: [msgpack.packb(v, use_bin_type=True)]),  # every type name, fields of any kind
    submit.map(lambda v: [msgpack.packb(v, use_bin_type=True)]),  # submissions, half well formed
    st.lists(st.binary(max_size=20), min_size=2, max_size=4),  # several frames
)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):
    engine = LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=48, num_kvcache_blocks=64)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"]


@pytest.fixture(scope="module")
def attacker(llm: LLM):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(llm.engine.endpoints.client)
    yield sock
    sock.close()


def _drain(sock: zmq.Socket, wait_ms: int) -> list[object]:
    """Every reply that comes within `wait_ms`; each must be a message the client side knows."""
    replies = []
    while sock.poll(wait_ms):
        reply = decode(sock.recv())
        # a well-formed StartProfile / StopProfile is answered (here: profiling is off), a GetEngineStats too
        assert isinstance(reply, (ErrorReply, RequestOutputs, Pong, EngineInfo, ProfileStatus, EngineStats)), reply
        replies.append(reply)
        wait_ms = 0
    return replies


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(message=frames)
def test_malformed_messages_of_every_type_never_take_the_engine_down(llm: LLM, expected: list[int],
                                                                    attacker: zmq.Socket, message: list[bytes]) -> None:
    attacker.send_multipart(message)
    _drain(attacker, 20)
    llm.engine.check()  # every process still alive


def test_after_the_fuzzing_a_normal_request_is_answered_exactly(llm: LLM, expected: list[int],
                                                                attacker: zmq.Socket) -> None:
    t0 = time.monotonic()
    attacker.send(msgpack.packb([PROTOCOL_VERSION, "Ping", 7]))
    replies = _drain(attacker, 10_000)
    while not any(isinstance(r, Pong) and r.nonce == 7 for r in replies):  # queued outputs first
        assert time.monotonic() - t0 < 60, replies
        replies = _drain(attacker, 10_000)
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    assert len(expected) == 8
