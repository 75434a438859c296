"""The wire protocol: every message survives a round trip, and `decode` refuses anything else with
`ProtocolError` (never another exception, never pickle); step plans stay small."""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import struct
import types
import typing
from pathlib import Path
from typing import Any, Union

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import protocol
from common.protocol import (
    PROTOCOL_VERSION,
    AddRequests,
    EngineRequest,
    Float32Array,
    GenerateRequest,
    Int32Array,
    LogprobColumns,
    Logprobs,
    NewBlocks,
    NewRequest,
    Ping,
    PositionLogprobs,
    ProtocolError,
    RequestOutput,
    RequestOutputs,
    ResumedRequest,
    SampleOutput,
    StepOutputs,
    StepPlan,
    StepResult,
    Submit,
    TopLogprob,
    decode,
    encode,
    f32,
    i32,
)

MESSAGE_NAMES = sorted(protocol.MESSAGE_TYPES)


# ============================================================================ example messages
# Fields appended (with defaults) after the bytes of this protocol version were recorded, by struct: the
# recorded examples leave them at their defaults, so those bytes stay what an older peer of the version sends
# and reads. (Version 1's three appended fields were folded into version 2's recording.)
FIELDS_AFTER_RECORDING: dict[str, tuple[str, ...]] = {}


def example_value(hint: Any, salt: int, recorded_only: bool = False) -> Any:
    """A value of type `hint` that is never a field default (non-empty, non-zero, not None); `recorded_only`: structs
    with their `FIELDS_AFTER_RECORDING` at their defaults."""
    origin = typing.get_origin(hint)
    if hint is Int32Array:
        return i32([salt, -salt, 2**31 - 1, -(2**31)])
    if hint is Float32Array:
        return f32([0.5 * salt, -float("inf"), 3.4e38, -1e-30])
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return example_value(inner[-1], salt, recorded_only)  # the last alternative: a value the earlier ones refuse
    if origin is list:
        (item,) = typing.get_args(hint)
        return [example_value(item, salt + 1, recorded_only), example_value(item, salt + 2, recorded_only)]
    if origin is dict:
        key, value = typing.get_args(hint)
        if key is int and value is float:
            return {salt: 0.5 * salt, 7: -100.0}
        if key is int and value is str:
            return {salt: "why-价格", 2**40: ""}
        if key is int:
            return {salt: 3 * salt, 2**40: 0}
        if value in (float, int | float):
            return {"ttft_s": 0.125 * salt, "e2e_s": 2.5}
        if value is int:
            return {"stop": salt, "length": 2 * salt}
        return {"model": "tiny", "nested": {"ids": [1, 2, 3], "ok": True, "raw": b"\x00\xff", "none": None}}
    if dataclasses.is_dataclass(hint):
        return example_message(hint, salt, recorded_only)
    if hint is bool:
        return True  # the opposite of a bool field's default (example_message turns a default True off)
    if hint is int:
        return 1000 * salt + 7
    if hint is float:
        return 0.5 + salt
    if hint is str:
        return f"value-{salt}-价格-👍🏽"
    if hint is bytes:
        return bytes([0xF0, 0x9F, salt % 256])  # a piece of a UTF-8 character
    if hint is Any:
        return {"any": [salt]}
    raise AssertionError(f"no example for field type {hint!r}: extend example_value")


def example_message(cls: type, salt: int = 1, recorded_only: bool = False) -> Any:
    hints = typing.get_type_hints(cls)
    later = FIELDS_AFTER_RECORDING.get(cls.__name__, ()) if recorded_only else ()

    def example(f: dataclasses.Field, i: int) -> Any:
        if hints[f.name] is bool and f.default is True:  # a switch that is on by default: the example turns it off
            return False
        return example_value(hints[f.name], salt + i, recorded_only)

    return cls(**{f.name: example(f, i) for i, f in enumerate(dataclasses.fields(cls)) if f.name not in later})


def required_fields_only(cls: type, salt: int = 3, recorded_only: bool = False) -> Any:
    """An instance of `cls` with its required fields set (as `example_value` makes them), the rest at their defaults."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: example_value(hints[f.name], salt, recorded_only)
                  for f in dataclasses.fields(cls) if field_default(f) is dataclasses.MISSING})


def assert_same_message(actual: Any, expected: Any, where: str = "message") -> None:
    """Field-by-field equality, with int32 arrays compared by value and dtype, and exact types."""
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, where
        assert np.array_equal(actual, expected), where
    elif dataclasses.is_dataclass(expected):
        assert type(actual) is type(expected), where
        for f in dataclasses.fields(expected):
            assert_same_message(getattr(actual, f.name), getattr(expected, f.name), f"{where}.{f.name}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_message(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r} != {expected!r}"


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def assert_no_field_at_default(msg: Any, where: str) -> None:
    for f in dataclasses.fields(msg):
        value, default = getattr(msg, f.name), field_default(f)
        if isinstance(value, np.ndarray):
            assert len(value) > 0, f"{where}.{f.name}"
        elif default is not dataclasses.MISSING:
            assert value != default, f"{where}.{f.name} is at its default"
        for item in value if isinstance(value, list) else [value]:
            if dataclasses.is_dataclass(item):
                assert_no_field_at_default(item, f"{where}.{f.name}")


def wire_fields(msg: Any) -> list[Any]:
    """The field values of an encoded message, as they travel."""
    version, name, *fields = msgpack.unpackb(encode(msg), raw=False, strict_map_key=False)
    assert (version, name) == (PROTOCOL_VERSION, type(msg).__name__)
    return fields


def pack(*items: Any) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


def num_required_fields(cls: type) -> int:
    return sum(field_default(f) is dataclasses.MISSING for f in dataclasses.fields(cls))


# ============================================================================ round trips
@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_every_message_type_round_trips_with_every_field_set(name: str) -> None:
    cls = protocol.MESSAGE_TYPES[name]
    msg = example_message(cls)
    assert_no_field_at_default(msg, name)

    assert_same_message(decode(encode(msg)), msg)


@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_every_message_type_round_trips_with_its_defaults(name: str) -> None:
    msg = required_fields_only(protocol.MESSAGE_TYPES[name])

    assert_same_message(decode(encode(msg)), msg)


def test_step_plan_with_nested_requests_round_trips() -> None:
    plan = StepPlan(
        step_id=41,
        new_requests=[NewRequest(7, i32([151644, 872, 198]), 0.0, None, i32([3]), 0, 3),
                      NewRequest(8, i32(range(1000, 1300)), 0.8, 1234, i32([4, 9]), 256, 44)],
        resumed_requests=[ResumedRequest(5, i32([11, 12, 13]), 32, 1)],
        prefill_seq_ids=i32([2]),
        prefill_num_tokens=i32([512]),
        decode_seq_ids=i32([1, 3, 4]),
        new_blocks=[NewBlocks(3, i32([20]))],
        finished_seq_ids=i32([6]),
        preempted_seq_ids=i32([9, 10]),
    )

    decoded = decode(encode(plan))

    assert_same_message(decoded, plan)
    assert decoded.new_requests[0].seed is None and decoded.new_requests[1].seed == 1234


def test_decoded_int32_arrays_are_read_only_little_endian_views() -> None:
    decoded = decode(encode(StepOutputs(3, i32([1, 2]), i32([70000, -1]))))

    assert decoded.token_ids.dtype == np.dtype("<i4")
    assert decoded.token_ids.tolist() == [70000, -1]
    assert not decoded.token_ids.flags.writeable


def test_int32_arrays_travel_as_msgpack_bin_of_little_endian_int32() -> None:
    (step_id, seq_ids, token_ids, *_) = wire_fields(StepOutputs(3, i32([1, 258]), i32([-1, 0])))

    assert step_id == 3
    assert seq_ids == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    assert token_ids == b"\xff\xff\xff\xff\x00\x00\x00\x00"


def test_int_given_for_a_float_field_decodes_as_float() -> None:
    fields = wire_fields(AddRequests([EngineRequest(1, i32([5]), 0.5, 4, None, [], 1.0)]))
    fields[0][0][2] = 1  # temperature sent by a peer that wrote the integer 1

    decoded = decode(pack(PROTOCOL_VERSION, "AddRequests", *fields))

    assert decoded.requests[0].temperature == 1.0 and type(decoded.requests[0].temperature) is float


def test_union_fields_keep_the_first_type_that_fits() -> None:
    """Counters stay integers and times stay floats in a `dict[str, int | float]` (num_preemptions
    used to reach users as 0.0); a value of neither type is refused."""
    out = RequestOutput("r1", finished=True, metrics={"num_preemptions": 2, "ttft_s": 0.25})

    decoded = decode(encode(RequestOutputs([out]))).outputs[0]

    assert decoded.metrics == {"num_preemptions": 2, "ttft_s": 0.25}
    assert type(decoded.metrics["num_preemptions"]) is int and type(decoded.metrics["ttft_s"]) is float
    with pytest.raises(ProtocolError, match="metrics"):
        decode(encode(RequestOutputs([RequestOutput("r1", metrics={"x": "slow"})])))


# ============================================================================ the recorded bytes of this version
# Recorded once when this version began (see "about" in the file): the code must go on writing the same bytes.
WIRE_BYTES = json.loads((Path(__file__).parent / "data" / "wire_bytes_v2.json").read_text(encoding="utf-8"))


def le_i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def le_f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_the_recorded_bytes_cover_every_message_type_of_this_version() -> None:
    assert WIRE_BYTES["protocol_version"] == PROTOCOL_VERSION
    assert sorted(WIRE_BYTES["every_field"]) == sorted(WIRE_BYTES["required_only"]) == MESSAGE_NAMES


@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_every_message_type_encodes_to_the_recorded_bytes_and_decodes_them(name: str) -> None:
    cls = protocol.MESSAGE_TYPES[name]
    for kind, msg in (("every_field", example_message(cls, recorded_only=True)),
                      ("required_only", required_fields_only(cls, recorded_only=True))):
        recorded = bytes.fromhex(WIRE_BYTES[kind][name])

        assert encode(msg) == recorded, \
            f"{name} ({kind}) no longer encodes to the recorded bytes of protocol version {PROTOCOL_VERSION}"
        assert_same_message(decode(recorded), msg, f"{name} ({kind})")


def test_a_ping_is_eight_bytes_of_msgpack() -> None:
    assert encode(Ping(7)) == b"\x93\x02\xa4Ping\x07"  # fixarray of 3: version 2, fixstr "Ping", nonce 7
    assert encode(Ping()) == b"\x92\x02\xa4Ping"  # the nonce at its default is left off


def test_a_step_plan_is_the_array_of_its_fields_up_to_the_last_one_set() -> None:
    plan = StepPlan(7, new_requests=[NewRequest(3, i32([151644, 872]), 0.5, None, i32([9]), 0, 2)],
                    decode_seq_ids=i32([4, 5]), new_blocks=[NewBlocks(4, i32([10, 11]))])

    # NewRequest without its options, StepPlan without finished / preempted ids and forks: all at their defaults.
    expected = pack(PROTOCOL_VERSION, "StepPlan", 7, [[3, le_i32(151644, 872), 0.5, None, le_i32(9), 0, 2]], [],
                    b"", b"", le_i32(4, 5), [[4, le_i32(10, 11)]])
    assert encode(plan) == expected


def test_a_step_result_with_logprobs_carries_them_as_int32_and_float32_bin() -> None:
    result = StepResult(9, i32([11, 12]), {"gpu_ms": 1.5},
                        Logprobs(i32([1]), i32([1]), i32([2]), f32([-0.25]), i32([1]), i32([12, 13]), f32([-0.25, -2])))

    expected = pack(PROTOCOL_VERSION, "StepResult", 9, le_i32(11, 12), {"gpu_ms": 1.5},
                    [le_i32(1), le_i32(1), le_i32(2), le_f32(-0.25), le_i32(1), le_i32(12, 13), le_f32(-0.25, -2)])
    assert encode(result) == expected


def test_a_submission_carries_each_request_up_to_its_last_field_set() -> None:
    submit = Submit([GenerateRequest("r1", prompt="hi", stream=True), GenerateRequest("r2", prompt_token_ids=[5])],
                    all_or_nothing=True)

    expected = pack(PROTOCOL_VERSION, "Submit", [["r1", "hi", None, None, {}, True], ["r2", None, [5]]], True)
    assert encode(submit) == expected


# ============================================================================ encode
class Impostor:
    """Not a protocol message, though it is named like one."""

    nonce = 1


Impostor.__name__ = "Ping"


@pytest.mark.parametrize(
    "not_a_message",
    [GenerateRequest("r1", prompt="hi"), RequestOutput("r1"), {"nonce": 1}, [1, "Ping", 0], b"", None, Impostor()],
    ids=["struct-GenerateRequest", "struct-RequestOutput", "dict", "list", "bytes", "None", "look-alike-class"],
)
def test_encode_refuses_anything_but_a_registered_message(not_a_message: Any) -> None:
    with pytest.raises(TypeError, match="not a protocol message"):
        encode(not_a_message)


def test_encode_refuses_ids_outside_int32_instead_of_wrapping_them() -> None:
    with pytest.raises((OverflowError, ValueError, TypeError)):
        encode(StepOutputs(1, np.array([2**32 + 5], dtype=np.int64), i32([1])))


# ============================================================================ decode errors
PING_FIELDS = wire_fields(Ping(7))
REQUEST_FIELDS = wire_fields(AddRequests([EngineRequest(1, i32([5, 6]), 0.5, 4, 9, [2], 1.0)]))[0][0]


def add_requests_with(index: int, value: Any) -> bytes:
    fields = list(REQUEST_FIELDS)
    fields[index] = value
    return pack(PROTOCOL_VERSION, "AddRequests", [fields])


MALFORMED = {
    # not msgpack
    "empty": b"",
    "reserved-byte": b"\xc1",
    "truncated": pack(PROTOCOL_VERSION, "Ping", 7)[:-1],
    "trailing-garbage": pack(PROTOCOL_VERSION, "Ping", 7) + b"\x00",
    "json": b'[1, "Ping", 7]',
    # not an array
    "map": msgpack.packb({"version": 1, "type": "Ping"}),
    "int": msgpack.packb(1),
    "string": msgpack.packb("Ping"),
    "array-of-one": pack(PROTOCOL_VERSION),
    # wrong version
    "version-0": pack(0, "Ping", 7),
    "version-2": pack(PROTOCOL_VERSION + 1, "Ping", 7),
    "version-as-string": pack("1", "Ping", 7),
    "version-none": pack(None, "Ping", 7),
    "version-array": pack([1], "Ping", 7),
    # unknown type
    "unknown-name": pack(PROTOCOL_VERSION, "Pong2", 7),
    "lowercase-name": pack(PROTOCOL_VERSION, "ping", 7),
    "struct-not-message": pack(PROTOCOL_VERSION, "GenerateRequest", "r1"),
    "name-as-int": pack(PROTOCOL_VERSION, 5, 7),
    "name-as-array": pack(PROTOCOL_VERSION, ["Ping"], 7),
    # a field of the wrong type
    "str-for-int": pack(PROTOCOL_VERSION, "Ping", "7"),
    "float-for-int": pack(PROTOCOL_VERSION, "Ping", 7.0),
    "bool-for-int": pack(PROTOCOL_VERSION, "Ping", True),
    "none-for-int": pack(PROTOCOL_VERSION, "Ping", None),
    "int-for-str": pack(PROTOCOL_VERSION, "WorkerReady", 0, 10, 4096, 5),
    "bytes-for-str": pack(PROTOCOL_VERSION, "ProcessFailed", "worker-tp0", b"boom"),
    "int-for-bool": pack(PROTOCOL_VERSION, "Submit", [], 1),
    "array-for-map": pack(PROTOCOL_VERSION, "ProcessReady", "frontend", [1, 2]),
    "str-for-array": pack(PROTOCOL_VERSION, "Abort", "r1"),
    "int-in-str-array": pack(PROTOCOL_VERSION, "Abort", ["r1", 2]),
    "int-for-optional-str": pack(PROTOCOL_VERSION, "RequestOutputs", [["r1", "", [], True, 3]]),
    "list-for-int32-bytes": pack(PROTOCOL_VERSION, "StepPlan", 1, [], [], b"", b"", [1, 2]),
    "odd-length-int32-bytes": pack(PROTOCOL_VERSION, "StepPlan", 1, [], [], b"", b"", b"\x01\x00\x00"),
    "str-for-int32-bytes": pack(PROTOCOL_VERSION, "StepResult", 1, "\x01\x00\x00\x00"),
    "str-for-float": add_requests_with(2, "0.5"),
    "bool-for-float": add_requests_with(2, True),
    "str-for-optional-int": add_requests_with(4, "9"),
    "float-in-int-array": add_requests_with(5, [2.0]),
    # a nested struct malformed
    "nested-not-an-array": pack(PROTOCOL_VERSION, "Submit", [5]),
    "nested-map": pack(PROTOCOL_VERSION, "Submit", [{"request_id": "r1"}]),
    "nested-missing-required": pack(PROTOCOL_VERSION, "Submit", [[]]),
    "nested-wrong-type": pack(PROTOCOL_VERSION, "Submit", [["r1", 7]]),
    "nested-list-for-int32-bytes": pack(PROTOCOL_VERSION, "StepPlan", 1, [], [], b"", b"", b"", [[3, [20]]]),
    "nested-missing-reason": pack(PROTOCOL_VERSION, "StepOutputs", 1, b"", b"", [[4]]),
    "doubly-nested-bad-int32": pack(PROTOCOL_VERSION, "StepPlan", 1, [[7, b"\x01", 0.0, None, b"", 0, 1]]),
    # a required field missing
    "missing-all-fields": pack(PROTOCOL_VERSION, "ProcessReady"),
    "missing-later-required": pack(PROTOCOL_VERSION, "WorkerReady", 0, 10),
    "missing-nested-required": pack(PROTOCOL_VERSION, "AddRequests", [REQUEST_FIELDS[:3]]),
    # pickle, which must never be unpickled
    "pickle-protocol-2": pickle.dumps(Ping(7), protocol=2),
    "pickle-protocol-5": pickle.dumps(Ping(7), protocol=5),
}


@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_input_raises_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize(
    "data",
    [pack(True, "Ping", 7), pack(1.0, "Ping", 7)],
    ids=["version-true", "version-float"],
)
def test_version_must_be_the_integer_protocol_version(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize(
    "data",
    [pack(PROTOCOL_VERSION, "StepOutputs", 1, b"", b"", [], {"a": "b"}),
     pack(PROTOCOL_VERSION, "RequestOutputs", [["r1", "", [], True, "stop", None, 0, 0, {"ttft_s": "slow"}]])],
    ids=["num_cached_tokens-str-to-str", "metrics-str-value"],
)
def test_map_fields_with_mistyped_keys_or_values_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


def test_decoding_a_pickle_never_runs_its_code() -> None:
    ran: list[str] = []

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return ran.append, ("pickle code ran",)

    payload = pickle.dumps(Payload())

    with pytest.raises(ProtocolError):
        decode(payload)
    assert ran == []


def test_error_message_names_the_bad_field() -> None:
    with pytest.raises(ProtocolError, match=r"AddRequests\.requests\[0\]\.temperature"):
        decode(add_requests_with(2, "hot"))


# ============================================================================ compatibility
@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_extra_trailing_fields_from_a_newer_peer_are_ignored(name: str) -> None:
    msg = example_message(protocol.MESSAGE_TYPES[name])
    data = pack(PROTOCOL_VERSION, name, *wire_fields(msg), "field-from-the-future", [1, {"x": 2}])

    assert_same_message(decode(data), msg)


def test_extra_trailing_fields_of_a_nested_struct_are_ignored() -> None:
    expected = GenerateRequest("r1", "hello", sampling={"max_tokens": 3}, stream=True)
    # A newer peer sends every field it knows up to the last that is not at its default, its own new one:
    # here every field of ours (defaults included), then the new one.
    request = [getattr(expected, f.name) for f in dataclasses.fields(GenerateRequest)] + ["field-from-the-future"]

    decoded = decode(pack(PROTOCOL_VERSION, "Submit", [request], True))

    assert_same_message(decoded, Submit([expected], all_or_nothing=True))


@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_missing_trailing_fields_from_an_older_peer_take_their_defaults(name: str) -> None:
    cls = protocol.MESSAGE_TYPES[name]
    msg = example_message(cls)
    fields = wire_fields(msg)
    for kept in range(num_required_fields(cls), len(fields)):
        defaults = {f.name: field_default(f) for f in dataclasses.fields(cls)[kept:]}

        assert_same_message(decode(pack(PROTOCOL_VERSION, name, *fields[:kept])),
                            dataclasses.replace(msg, **defaults))


def test_step_plan_with_only_a_step_id_has_empty_rows() -> None:
    plan = decode(pack(PROTOCOL_VERSION, "StepPlan", 12))

    assert plan.step_id == 12
    assert plan.new_requests == [] and plan.resumed_requests == [] and plan.new_blocks == []
    for ids in (plan.prefill_seq_ids, plan.prefill_num_tokens, plan.decode_seq_ids, plan.finished_seq_ids,
                plan.preempted_seq_ids):
        assert ids.dtype == np.dtype("<i4") and len(ids) == 0


@pytest.mark.parametrize("name", [n for n in MESSAGE_NAMES if num_required_fields(protocol.MESSAGE_TYPES[n])])
def test_missing_a_required_field_raises_protocol_error(name: str) -> None:
    cls = protocol.MESSAGE_TYPES[name]
    fields = wire_fields(example_message(cls))

    with pytest.raises(ProtocolError, match=name):
        decode(pack(PROTOCOL_VERSION, name, *fields[:num_required_fields(cls) - 1]))


# ============================================================================ fuzzing
def msgpack_values() -> st.SearchStrategy[Any]:
    scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
               | st.text(max_size=12) | st.binary(max_size=16) | st.sampled_from(MESSAGE_NAMES))
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), children, max_size=4),
        max_leaves=24,
    )


def message_shaped() -> st.SearchStrategy[list[Any]]:
    """[version, type name, fields...]: mostly the right version and real names, to reach field checks."""
    version = st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, None])
    name = st.sampled_from(MESSAGE_NAMES + ["GenerateRequest", "NewRequest", "Nope"])
    return st.tuples(version, name, st.lists(msgpack_values(), max_size=10)).map(lambda t: [t[0], t[1], *t[2]])


def assert_decodes_or_refuses(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert protocol.MESSAGE_TYPES[type(msg).__name__] is type(msg)


FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    assert_decodes_or_refuses(data)


@FUZZ
@given(msgpack_values() | message_shaped())
def test_random_msgpack_structures_only_ever_raise_protocol_error(obj: Any) -> None:
    assert_decodes_or_refuses(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(st.sampled_from(MESSAGE_NAMES), st.data())
def test_corrupted_valid_messages_only_ever_raise_protocol_error(name: str, data: st.DataObject) -> None:
    valid = bytearray(encode(example_message(protocol.MESSAGE_TYPES[name])))
    for _ in range(data.draw(st.integers(1, 4))):
        valid[data.draw(st.integers(0, len(valid) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(valid)))

    assert_decodes_or_refuses(bytes(valid[:cut]))


def decode_field_by_field(data: bytes) -> Any:
    """What `decode` gave before its checks were compiled: every field checked with its path."""
    _, name, *values = msgpack.unpackb(data, raw=False, strict_map_key=False)
    cls = protocol.MESSAGE_TYPES[name]
    return protocol.codec._checked_build(cls, values, name)


def outcome(decoder: Any, data: bytes) -> Any:
    try:
        return ("message", decoder(data))
    except ProtocolError as exc:
        return ("refused", str(exc))


@FUZZ
@given(st.sampled_from(MESSAGE_NAMES), st.data())
def test_the_compiled_checks_accept_and_refuse_exactly_what_the_field_by_field_checks_do(
        name: str, data: st.DataObject) -> None:
    valid = bytearray(encode(example_message(protocol.MESSAGE_TYPES[name])))
    for _ in range(data.draw(st.integers(1, 4))):
        valid[data.draw(st.integers(0, len(valid) - 1))] = data.draw(st.integers(0, 255))
    corrupted = bytes(valid)
    try:
        head = msgpack.unpackb(corrupted, raw=False, strict_map_key=False)
    except Exception:  # not msgpack any more: neither decoder gets to the fields
        return
    if not (isinstance(head, list) and len(head) >= 2 and head[0] == protocol.PROTOCOL_VERSION
            and isinstance(head[1], str) and head[1] in protocol.MESSAGE_TYPES):
        return
    fast, slow = outcome(decode, corrupted), outcome(decode_field_by_field, corrupted)
    assert fast[0] == slow[0]
    if fast[0] == "message":
        assert _same(fast[1], slow[1])
    else:
        assert fast[1] == slow[1]  # the same error, naming the same field


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        both = isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        return both and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def test_a_wrong_value_in_an_outputs_logprob_columns_is_named_by_its_field() -> None:
    top = [TopLogprob(j, -0.5, "abc") for j in range(5)]
    lps = [PositionLogprobs(i, -1.5, 2, "tok", list(top)) for i in range(4)]
    msg = RequestOutputs([RequestOutput("r1", "x", [1, 2, 3, 4], True, "length", logprobs=lps)])
    assert decode(encode(msg)) == msg
    fields = [f.name for f in dataclasses.fields(RequestOutput)]
    path = r"RequestOutputs\.outputs\[0\]\.logprobs"
    for column, value, why in ((6, ["tok"] * 4 + ["abc"] * 19 + [7], "expected 24 decoded tokens"),
                               (5, le_f32(*[-0.5] * 19), "the logprob columns differ in length"),
                               (3, le_i32(5, 5, 5, 6), "num_top does not add up"),
                               (1, "not bytes", "expected int32 / float32 bytes")):
        obj = msgpack.unpackb(encode(msg), raw=False, strict_map_key=False)
        obj[2][0][fields.index("logprobs")][column] = value
        with pytest.raises(ProtocolError, match=rf"^{path}: {why}"):
            decode(msgpack.packb(obj, use_bin_type=True))


def test_logprob_columns_travel_as_the_position_list_they_hold() -> None:
    cols = LogprobColumns()
    cols.append(5, -0.25, 1, "a", [5, 9], [-0.25, -2.0], ["a", "b"])
    cols.append(7, -3.0, 4, "c", [], [], [])
    cols.append(8, float("-inf"), 151936, "d", [1, 2, 3], [-0.5, -1.0, -1.5], ["x", "y", "z"])
    expected = [PositionLogprobs(5, -0.25, 1, "a", [TopLogprob(5, -0.25, "a"), TopLogprob(9, -2.0, "b")]),
                PositionLogprobs(7, -3.0, 4, "c", []),
                PositionLogprobs(8, float("-inf"), 151936, "d",
                                 [TopLogprob(1, -0.5, "x"), TopLogprob(2, -1.0, "y"), TopLogprob(3, -1.5, "z")])]

    assert cols.positions() == expected and LogprobColumns.of(expected).positions() == expected
    assert cols.since(1).positions() == expected[1:] and cols.since(3).positions() == []
    sample = SampleOutput(0, "acd", [5, 7, 8], logprobs=cols)
    as_columns = decode(encode(RequestOutputs([RequestOutput("r", samples=[sample])])))
    as_list = decode(encode(RequestOutputs([RequestOutput("r", samples=[SampleOutput(0, "acd", [5, 7, 8],
                                                                                      logprobs=expected)])])))
    assert as_columns == as_list and as_columns.outputs[0].samples[0].logprobs == expected
    assert decode(encode(RequestOutputs([RequestOutput("r", logprobs=[])]))).outputs[0].logprobs == []


@pytest.mark.parametrize("enabled", [True, False])
def test_reading_logprob_columns_pauses_the_garbage_collector_and_leaves_it_as_it_was(enabled: bool) -> None:
    cols = LogprobColumns()
    cols.append(5, -0.25, 1, "a", [5, 9], [-0.25, -2.0], ["a", "b"])
    seen = []

    class Watched(LogprobColumns):
        def _positions(self) -> list[PositionLogprobs]:
            seen.append(gc.isenabled())
            return super()._positions()

    watched = Watched()
    for name in LogprobColumns.__slots__:
        setattr(watched, name, getattr(cols, name))
    (gc.enable if enabled else gc.disable)()
    try:
        assert watched.positions() == cols.positions() and seen == [False]
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_the_dict_generate_returns_is_what_dataclasses_asdict_gives_field_for_field() -> None:
    """`output_dict` writes asdict out for speed (3.4 s against 0.4 s for throughput.py --filtered's outputs): a
    field added to a struct and not to it fails here."""
    from frontend.client import output_dict

    top = [TopLogprob(5, -0.25, "a"), TopLogprob(9, -2.0, "\ufffd", token_bytes=b"\xe4")]
    positions = [PositionLogprobs(5, -0.25, 1, "a", top), PositionLogprobs(9, -2.0, 2, "\ufffd", [], b"\xe4")]
    out = RequestOutput("r", text="a", token_ids=[5, 9], finished=True, finish_reason="stop", stop_reason=9,
                        logprobs=positions, cumulative_logprob=-2.25, num_prompt_tokens=2,
                        prompt_logprobs=[None, positions[0]],
                        samples=[SampleOutput(1, "b", [7], "length", None, [], -1.0, True)])
    got = output_dict(out)
    assert got["outputs"] == [dataclasses.asdict(s) for s in out.outputs]
    assert got["prompt_logprobs"] == [None, dataclasses.asdict(positions[0])]
    assert got["outputs"][0]["token_ids"] is not out.token_ids  # a copy, as asdict's
    assert got["outputs"][0]["logprobs"][0]["top"][1]["token_bytes"] == b"\xe4"


# ============================================================================ step plan size
def decode_plan(num_requests: int) -> StepPlan:
    return StepPlan(step_id=2**30, decode_seq_ids=i32(range(2**30, 2**30 + num_requests)))


def test_steady_decode_plan_for_256_requests_fits_in_2_kib() -> None:
    assert len(encode(decode_plan(256))) <= 2048


def test_decode_plan_grows_by_four_bytes_per_request() -> None:
    sizes = {n: len(encode(decode_plan(n))) for n in (1, 64, 256, 1024)}

    assert sizes[1] <= 64  # the fixed part: header, step id and empty rows
    for small, large in [(1, 64), (64, 256), (256, 1024)]:
        per_request = (sizes[large] - sizes[small]) / (large - small)
        assert 4.0 <= per_request <= 4.05, (small, large, sizes)


def steady_decode_plans(context_len: int, num_requests: int = 32) -> list[StepPlan]:
    """The plans the real scheduler sends once `num_requests` prompts of `context_len` tokens decode.

    Prompts are 2 tokens past a block boundary, so the first decode steps allocate no block.
    """
    from scheduler_proc.scheduler import Scheduler, SchedulerConfig

    block_size = 16
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=num_requests * (context_len // block_size + 2), block_size=block_size,
        max_model_len=context_len + 64, max_num_batched_tokens=num_requests * context_len))
    rng = np.random.default_rng(context_len)
    for seq_id in range(num_requests):
        prompt = i32(rng.integers(1000, 20000, size=context_len))
        assert scheduler.add_request(EngineRequest(seq_id, prompt, 0.0, 16, None, [], 0.0)) == []
    plans = []
    for _ in range(4):
        plan = scheduler.schedule()
        # Every row samples: whole prompts in the first step, single decode tokens after it.
        rows = len(plan.new_requests) + len(plan.resumed_requests) + len(plan.prefill_seq_ids)
        rows += len(plan.decode_seq_ids)
        scheduler.process_result(StepResult(plan.step_id, i32([100] * rows)))
        plans.append(plan)
    return plans[1:]


def test_decode_plan_size_does_not_depend_on_context_length() -> None:
    short_plans = steady_decode_plans(context_len=2 * 16 + 2)
    long_plans = steady_decode_plans(context_len=250 * 16 + 2)

    for short, long in zip(short_plans, long_plans):
        assert long.decode_seq_ids.tolist() == list(range(32))
        assert not long.new_requests and not long.new_blocks and not len(long.prefill_seq_ids)
        assert len(encode(long)) == len(encode(short)) <= 32 * 4 + 64



def test_wire_error_names_the_first_value_msgpack_cannot_take() -> None:
    from common.protocol import wire_error

    assert wire_error(GenerateRequest("a", prompt_token_ids=[2**64 - 1, -(2**63)])) is None
    assert wire_error(GenerateRequest("a", prompt_token_ids=[1, 2**64])) == \
        f"prompt_token_ids[1] is {2**64}, which does not fit in 64 bits"
    assert wire_error(GenerateRequest("a", prompt="x\ud800")).startswith("prompt is not valid Unicode text")
    assert wire_error(GenerateRequest("a", prompt="ok", sampling={"seed": np.int64(1)})) == \
        "sampling['seed'] is a int64, which cannot be sent (use int, float, str, list or dict)"


# ============================================================================ request parameters on the wire
def test_fields_at_their_defaults_cost_no_byte() -> None:
    """A request that asks for nothing new (no options, n = 1) and a step without logprobs or forks encode
    to exactly the bytes of the fields they had before those were appended."""
    req = EngineRequest(3, i32([5, 6, 7]), 0.7, 16, 9, [2], 1.5)
    old_fields = [3, i32([5, 6, 7]).tobytes(), 0.7, 16, 9, [2], 1.5]
    assert encode(AddRequests([req])) == pack(PROTOCOL_VERSION, "AddRequests", [old_fields])
    result = StepResult(4, i32([1, 2]), {"gpu_ms": 1.0})
    assert encode(result) == pack(PROTOCOL_VERSION, "StepResult", 4, i32([1, 2]).tobytes(), {"gpu_ms": 1.0})
    plan = StepPlan(5, decode_seq_ids=i32([1, 2]))
    assert len(encode(plan)) == len(pack(PROTOCOL_VERSION, "StepPlan", 5, [], [], b"", b"", i32([1, 2]).tobytes()))


def test_options_travel_once_and_only_the_fields_a_request_sets() -> None:
    from common.protocol import SamplingOptions

    plain = encode(AddRequests([EngineRequest(3, i32([5]), 0.7, 16, None, [], 1.5)]))
    top_k = encode(AddRequests([EngineRequest(3, i32([5]), 0.7, 16, None, [], 1.5, SamplingOptions(top_k=50))]))
    assert len(top_k) - len(plain) == 2  # the options struct: an array header and one small integer
    decoded = decode(top_k).requests[0].options
    assert decoded == SamplingOptions(top_k=50)


@pytest.mark.parametrize("num_top", [0, 5, 20])
def test_a_sampled_position_with_logprobs_costs_20_plus_8_n_bytes(num_top: int) -> None:
    def result(rows: int) -> StepResult:
        return StepResult(1, i32(range(300)), {}, Logprobs(
            i32(range(rows)), i32([1] * rows), i32([num_top] * rows), f32([-0.5] * rows), i32([2] * rows),
            i32(list(range(rows * num_top))), f32([-1.0] * (rows * num_top))))

    sizes = {rows: len(encode(result(rows))) for rows in (100, 200)}
    assert (sizes[200] - sizes[100]) / 100 == 20 + 8 * num_top


def test_request_output_lists_its_samples_in_index_order_for_any_n() -> None:
    from common.protocol import SampleOutput

    single = RequestOutput("r", "hi", [1, 2], finished=True, finish_reason="length")
    assert [(s.index, s.text, s.token_ids, s.finish_reason) for s in single.outputs] == [(0, "hi", [1, 2], "length")]
    several = RequestOutput("r", "b", [3], index=1, samples=[SampleOutput(3, "d", [5]), SampleOutput(0, "a", [4])])
    decoded = decode(encode(RequestOutputs([several]))).outputs[0]
    assert [(s.index, s.text) for s in decoded.outputs] == [(0, "a"), (1, "b"), (3, "d")]
