"""Every message at the client port is answered (hypothesis): a message that names a request gets that request's
output or an ErrorReply naming what is wrong, every other message its reply or an ErrorReply, within 1 s on an idle
engine; only an Abort goes unanswered. The messages are of every type, with fields well typed, out of range
(integers past 32, 53, 63 and 64 bits), empty, missing or of any other type. After them the engine still serves a
normal request exactly (the greedy tokens measured before)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import (
    MAX_REQUEST_ID_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Detokenize,
    DetokenizeResult,
    EngineInfo,
    EngineStats,
    ErrorReply,
    GetEngineInfo,
    GetEngineStats,
    Ping,
    Pong,
    ProfileStatus,
    ProtocolError,
    RequestOutputs,
    StartProfile,
    StopProfile,
    Submit,
    Tokenize,
    TokenizeResult,
    decode,
)
from deltaserve import LLM, SamplingParams
from frontend.process import INTERNAL_ERROR

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [1000, 2000, 3000, 4000]
MAX_MODEL_LEN = 16  # every accepted request ends within 15 tokens: its output comes well inside ANSWER_S
ANSWER_S = 1.0  # the rule's bound on an idle engine
# Examples per run: about 25 s here on two busy cores (most messages are refused within milliseconds, the
# accepted requests run up to 15 decode steps).
EXAMPLES = 600

def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each drawn in proportion to its weight (hypothesis' `one_of` favours none)."""
    return st.sampled_from([i for i, (weight, _) in enumerate(choices) for _ in range(weight)]).flatmap(
        lambda i: choices[i][1])


def mostly(valid: st.SearchStrategy, *others: st.SearchStrategy) -> st.SearchStrategy:
    """Three times in four a value in the field's range, else one of `others` (out of range, any type)."""
    return weighted((3, valid), *[(1, other) for other in others])


BOUNDARY_INTS = [-(2**63), -(2**31) - 1, -1, 0, 1, 2, 20, 21, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
                 151_668, 151_669]
ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(BOUNDARY_INTS))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0, 3.5e38]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.one_of(st.text(max_size=10), ints), inner,
                                                                       max_size=4)), max_leaves=20)
token_id = mostly(st.integers(0, 151_668), ints)


def mutated(fields: st.SearchStrategy, n: int) -> st.SearchStrategy:
    """The `n` fields drawn from `fields`; then, each a quarter of the time, one field replaced by anything at all
    and the list cut after a random count of fields (the missing ones take their defaults, or make the message
    malformed)."""
    if not n:
        return st.just([])

    def mutate(drawn: tuple) -> list:
        fields_, wrong, anything, cut = drawn
        out = list(fields_)
        if wrong is not None:
            out[wrong] = anything
        return out if cut is None else out[:cut]

    sometimes_a_field = mostly(st.none(), st.integers(0, n - 1))
    return st.tuples(fields, sometimes_a_field, values, sometimes_a_field).map(mutate)


def some_fields(strategies: dict[str, st.SearchStrategy], extra: list[str]) -> st.SearchStrategy:
    """A map of a few of these fields (and unknown names), each value from its field's strategy or, one time
    in eight, anything at all."""
    return st.lists(st.sampled_from(sorted(strategies) + extra), unique=True, max_size=3).flatmap(
        lambda names: st.fixed_dictionaries({n: weighted((7, strategies.get(n, values)), (1, values)) for n in names}))


STRUCTURED_FIELDS = {
    "json": st.one_of(st.sampled_from([{}, {"type": "string"}, {"type": "object", "required": ["a"],
                                                                "properties": {"a": {"type": "integer"}}}]),
                      st.dictionaries(st.one_of(st.text(max_size=5), st.binary(max_size=3)), values, max_size=3),
                      st.text(max_size=10), st.booleans()),
    "regex": st.one_of(st.sampled_from(["[ab]+", "a|bc", "(", ""]), st.text(max_size=8)),
    "choice": st.lists(st.text(max_size=5), max_size=3),
    "grammar": st.one_of(st.sampled_from(['root ::= "a" | "b"', "root ::=", "x"]), st.text(max_size=10)),
    "json_object": st.booleans(),
    "disable_any_whitespace": st.booleans(),
}
SAMPLING_FIELDS = {
    "temperature": mostly(st.sampled_from([0.0, 0.5, 1.0]), floats, ints),
    "max_tokens": mostly(st.integers(1, 4), ints),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(token_id, max_size=3),
    "seed": mostly(st.none() | st.integers(0, 2**63 - 1), ints),
    "skip_special_tokens": st.booleans(),
    "n": mostly(st.integers(1, 3), ints),
    "top_p": mostly(st.floats(0.01, 1.0), floats),
    "top_k": mostly(st.integers(-1, 5), ints),
    "min_p": mostly(st.floats(0.0, 1.0), floats),
    "presence_penalty": mostly(st.floats(-2.0, 2.0), floats),
    "frequency_penalty": mostly(st.floats(-2.0, 2.0), floats),
    "repetition_penalty": mostly(st.floats(0.5, 2.0), floats),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.one_of(token_id, token_id.map(str)),
                                                       mostly(st.floats(-100, 100), floats), max_size=3)),
    "bad_words": st.one_of(st.none(), st.lists(st.text(max_size=8), max_size=3)),
    "min_tokens": mostly(st.integers(0, 4), ints),
    "stop": st.one_of(st.none(), st.text(max_size=6), st.lists(st.text(max_size=6), max_size=3)),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": mostly(st.none() | st.integers(0, 20), ints),
    "prompt_logprobs": mostly(st.none() | st.integers(0, 20), ints),
    "structured_outputs": st.one_of(st.none(), some_fields(STRUCTURED_FIELDS, ["other"])),
}
chat = st.lists(st.dictionaries(st.sampled_from(["role", "content", "tool_calls"]),
                                mostly(st.sampled_from(["user", "assistant", "system"]), st.text(max_size=12), values)),
                max_size=3)
prompt_text = mostly(st.text(min_size=1, max_size=20), st.just(""))
prompt_ids = mostly(st.lists(token_id, min_size=1, max_size=6), st.just([]))
# (prompt, prompt_token_ids, messages): mostly exactly one of them, sometimes none or two
prompts = weighted(
    (3, st.tuples(prompt_text, st.none(), st.none())),
    (3, st.tuples(st.none(), prompt_ids, st.none())),
    (2, st.tuples(st.none(), st.none(), chat)),
    (1, st.tuples(st.none(), st.none(), st.none())),
    (1, st.tuples(prompt_text, prompt_ids, st.none())),
)
request = mutated(st.tuples(
    mostly(st.text(max_size=8), st.text(min_size=MAX_REQUEST_ID_CHARS + 1, max_size=MAX_REQUEST_ID_CHARS + 3)),
    prompts,
    some_fields(SAMPLING_FIELDS, ["", "unknown"]),  # sampling
    st.booleans(),  # stream
    st.booleans(),  # add_generation_prompt
    st.booleans(),  # continue_final_message
    st.dictionaries(st.text(max_size=8), values, max_size=2),  # chat_template_kwargs
    st.one_of(st.none(), st.booleans()),  # add_special_tokens
    st.booleans(),  # max_tokens_within_context
).map(lambda t: (t[0], *t[1], *t[2:])), 11)


def message(name: str, *fields: st.SearchStrategy) -> st.SearchStrategy:
    """[version, name, fields...], the fields `mutated`."""
    return mutated(st.tuples(*fields), len(fields)).map(lambda fields_: [PROTOCOL_VERSION, name, *fields_])


client_messages = weighted(
    (8, message("Submit", mostly(st.lists(request, min_size=1, max_size=3), st.just([])), st.booleans())),
    (2, message("Tokenize", ints, request)),
    (1, message("Detokenize", ints, st.lists(token_id, max_size=6), st.booleans())),
    (1, message("GetEngineStats", ints)),
    (1, message("GetEngineInfo")),
    (1, message("Ping", ints)),
    (1, message("StartProfile", ints)),
    (1, message("StopProfile")),
    (1, message("Abort", st.lists(st.text(max_size=8), max_size=3))),
)
any_type = st.tuples(st.one_of(st.just(PROTOCOL_VERSION), values), st.one_of(st.sampled_from(sorted(MESSAGE_TYPES)),
                                                                               values),
                     st.lists(values, max_size=8)).map(lambda t: [t[0], t[1], *t[2]])
frames = weighted(
    (6, client_messages.map(lambda v: [msgpack.packb(v, use_bin_type=True)])),  # every client message, any fields
    (1, st.binary(max_size=200).map(lambda b: [b])),  # not msgpack, or truncated msgpack
    (1, values.map(lambda v: [msgpack.packb(v, use_bin_type=True)])),  # msgpack, but not a message
    (1, any_type.map(lambda v: [msgpack.packb(v, use_bin_type=True)])),  # every type name, fields of any kind
    (1, st.lists(st.binary(max_size=20), min_size=2, max_size=4)),  # several frames
)


@dataclass
class Expected:
    """What must come back for one message: the replies that answer it, by kind."""

    error_reply: bool = False  # one ErrorReply: the message as a whole is refused
    reply_type: type | None = None  # else one reply of this type ...
    reply_id: int | None = None  # ... carrying this reply_id (or Pong nonce)
    request_ids: Counter[str] = field(default_factory=Counter)  # each: a finished RequestOutput, or refused by id
    long_ids: list[int] = field(default_factory=list)  # indices of requests refused for their request_id's length

    def met_by(self, replies: list[object]) -> bool:
        errors = [r for r in replies if isinstance(r, ErrorReply)]
        if self.error_reply:
            return bool(errors)
        if self.reply_type is not None:
            return any(isinstance(r, self.reply_type) and getattr(r, "reply_id", getattr(r, "nonce", None))
                       == self.reply_id for r in replies)
        answered = Counter(o.request_id for r in replies if isinstance(r, RequestOutputs) for o in r.outputs
                           if o.finished)
        answered.update(i for e in errors for i in e.refused_request_ids)
        return self.request_ids <= answered and all(
            any(f"Submit.requests[{i}] " in e.error for e in errors) for i in self.long_ids)


def expected_for(frames: list[bytes]) -> Expected | None:
    """The answer the rule demands for `frames`; None for an Abort (answered by nothing)."""
    if len(frames) != 1:
        return Expected(error_reply=True)
    try:
        msg = decode(frames[0])
    except ProtocolError:
        return Expected(error_reply=True)
    if isinstance(msg, Abort):
        return None
    if isinstance(msg, Submit):
        if not msg.requests:
            return Expected(error_reply=True)
        return Expected(request_ids=Counter(r.request_id for r in msg.requests
                                            if len(r.request_id) <= MAX_REQUEST_ID_CHARS),
                        long_ids=[i for i, r in enumerate(msg.requests) if len(r.request_id) > MAX_REQUEST_ID_CHARS])
    replies = {Tokenize: TokenizeResult, Detokenize: DetokenizeResult, GetEngineStats: EngineStats, Ping: Pong,
               GetEngineInfo: EngineInfo, StartProfile: ProfileStatus, StopProfile: ProfileStatus}
    if type(msg) not in replies:  # another socket's message
        return Expected(error_reply=True)
    return Expected(reply_type=replies[type(msg)], reply_id=getattr(msg, "reply_id", getattr(msg, "nonce", None)))


def answers(sock: zmq.Socket, want: Expected, within_s: float) -> list[object]:
    """The replies on `sock` until `want` is met; fails if it is not within `within_s` of now."""
    replies: list[object] = []
    deadline = time.monotonic() + within_s
    while not want.met_by(replies):
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(left * 1000), f"no full answer within {within_s} s; got {replies}"
        replies.append(decode(sock.recv()))
    return replies


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):
    engine = LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=64,
                 max_num_seqs=4)
    # Structured outputs set up the grammar compiler at their first request: done here, not inside a timed answer.
    engine.generate(["a"], SamplingParams(max_tokens=2, structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"]


def send_and_check(llm: LLM, frames: list[bytes]) -> list[object]:
    """Send `frames` from a fresh client and check the rule on what comes back; the replies."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(llm.engine.endpoints.client)
    try:
        sock.send_multipart(frames)
        want = expected_for(frames)
        if want is None:
            assert not sock.poll(50), decode(sock.recv())
            return []
        replies = answers(sock, want, ANSWER_S)
    finally:
        sock.close()
    for reply in replies:
        text = reply.error if isinstance(reply, ErrorReply) else ""
        if isinstance(reply, RequestOutputs):
            text = " ".join(o.error or "" for o in reply.outputs)
            assert all(o.error for o in reply.outputs if o.finish_reason == "error"), reply
        assert INTERNAL_ERROR not in text, reply  # a fault of the frontend's, not a refusal of the input
    return replies


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(message=frames)
def test_every_message_of_every_type_is_answered_within_a_second(llm: LLM, expected: list[int],
                                                                message: list[bytes]) -> None:
    send_and_check(llm, message)
    llm.engine.check()  # every process still alive


def test_an_empty_submission_is_refused_naming_its_requests_field(llm: LLM) -> None:
    (reply,) = send_and_check(llm, [msgpack.packb([PROTOCOL_VERSION, "Submit", []])])
    assert reply.error == "Submit.requests is empty: a submission needs at least one request"


@pytest.mark.parametrize("fields", [
    ["a", "hi"], ["a", None, [1000, 2000]], ["a", None, None, [{"role": "user", "content": "x"}]],
], ids=["prompt", "prompt_token_ids", "messages"])
@pytest.mark.parametrize("sampling", [{"max_tokens": 2**63 - 1}, {"max_tokens": 2**63 - 1, "ignore_eos": True,
                                                                   "temperature": 0.0}])
def test_max_tokens_of_2_63_minus_1_runs_to_max_model_len(llm: LLM, fields: list, sampling: dict) -> None:
    msg = [PROTOCOL_VERSION, "Submit", [[*fields, *[None] * (4 - len(fields)), sampling]]]
    outs = [o for r in send_and_check(llm, [msgpack.packb(msg)]) for o in r.outputs]
    (out,) = outs
    if out.error is not None:  # the chat template's prompt alone is longer than max_model_len
        assert fields[3] is not None and "max_model_len is 16" in out.error
        return
    assert out.finish_reason in ("length", "stop"), out
    if sampling.get("ignore_eos"):
        assert out.finish_reason == "length" and out.num_prompt_tokens + len(out.token_ids) == MAX_MODEL_LEN


def test_default_sampling_parameters_get_an_output(llm: LLM) -> None:
    msg = [PROTOCOL_VERSION, "Submit", [["a", None, PROMPT, None, {}]]]
    (reply,) = send_and_check(llm, [msgpack.packb(msg)])
    (out,) = reply.outputs
    assert out.finished and out.error is None and out.finish_reason in ("length", "stop") and out.token_ids


def test_a_json_schema_that_is_no_json_is_refused_naming_the_field(llm: LLM, expected: list[int]) -> None:
    msg = [PROTOCOL_VERSION, "Submit", [["a", "hi", None, None, {"structured_outputs": {"json": {b"k": 1}}}]]]
    (reply,) = send_and_check(llm, [msgpack.packb(msg, use_bin_type=True)])
    (out,) = reply.outputs
    assert out.finish_reason == "error" and out.error.startswith("structured_outputs.json is not a JSON document")
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def test_a_request_id_repeated_in_one_submission_runs_once_and_is_refused_once(llm: LLM) -> None:
    msg = [PROTOCOL_VERSION, "Submit", [["a", None, PROMPT, None, {"max_tokens": 2}]] * 2]
    replies = send_and_check(llm, [msgpack.packb(msg)])
    (refusal,) = [r for r in replies if isinstance(r, ErrorReply)]
    (out,) = [o for r in replies if isinstance(r, RequestOutputs) for o in r.outputs]
    assert refusal.refused_request_ids == ["a"] and out.error is None and len(out.token_ids) == 2


def test_after_the_fuzzing_a_normal_request_is_answered_exactly(llm: LLM, expected: list[int]) -> None:
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    assert len(expected) == 8
