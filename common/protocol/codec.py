"""The codec: `encode` and `decode`, the checks a decoded message passes, and the wire's building blocks.

A message is the msgpack array ``[PROTOCOL_VERSION, type_name, field_1, field_2, ...]``; a nested struct
is the plain array of its fields. `wire_struct` makes a class a struct (a dataclass whose fields travel in
declaration order), `wire_message` a message (a struct registered by name in `MESSAGE_TYPES`); the
message modules of this package (`common.protocol.launcher`, `.client`, ...) declare every one, and
importing `common.protocol` registers them all. A field's type hint decides how it travels and how it is
checked on decode: `Int32Array` and `Float32Array` as msgpack bin of little-endian 4-byte values, a struct
as its array, `X | None`, `list[...]`, `dict[..., ...]`, int, float, str, bool, bytes as msgpack has them.

The rules of the wire (versions, trailing defaults, deltas) are in the docstring of `common.protocol`.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import numpy as np

from common.errors import quote

PROTOCOL_VERSION = 2  # 2: an output's logprobs travel as columns (common.protocol.client.LogprobColumns)


class ProtocolError(ValueError):
    """A message could not be decoded (malformed, wrong version, unknown type, bad field)."""


class Int32Array:
    """Annotation marker: a 1-D int32 `numpy.ndarray` carried as msgpack bin (little-endian).

    Decoded arrays are read-only views of the received bytes; copy before writing into them.
    """


def i32(values: Any) -> np.ndarray:
    """A contiguous little-endian int32 array from a list, range or array.

    Raises `OverflowError` for a value outside the int32 range (never wraps silently).
    """
    if isinstance(values, np.ndarray) and values.dtype != np.int32 and values.size:
        if int(values.min()) < -(2**31) or int(values.max()) >= 2**31:
            raise OverflowError("a value does not fit in int32")
    return np.ascontiguousarray(values, dtype="<i4")


EMPTY_I32 = np.zeros(0, dtype="<i4")
EMPTY_I32.setflags(write=False)


def empty_i32_field() -> Any:
    """A dataclass field whose default is the empty int32 array (shared and read-only, so never mutated)."""
    return field(default_factory=lambda: EMPTY_I32)


class Float32Array:
    """Annotation marker: a 1-D float32 `numpy.ndarray` carried as msgpack bin (little-endian IEEE 754).

    Decoded arrays are read-only views of the received bytes; copy before writing into them.
    """


def f32(values: Any) -> np.ndarray:
    """A contiguous little-endian float32 array from a list or array (values round to float32)."""
    return np.ascontiguousarray(values, dtype="<f4")


EMPTY_F32 = np.zeros(0, dtype="<f4")
EMPTY_F32.setflags(write=False)


MESSAGE_TYPES: dict[str, type] = {}  # type name -> message class, every message of every socket
_HINTS: dict[type, list[tuple[str, Any]]] = {}
# Field types with a wire form of their own (`wire_form`): hint -> (to wire, from wire), and the extra Python
# types that their `to_wire` accepts (so `wire_error` lets them through).
_FORMS: dict[Any, tuple[Callable[[Any], Any], Callable[[Any, str], Any]]] = {}
_FORM_TYPES: set[type] = set()
# Per struct, each field's encoder when its hint (or the hint inside `X | None`) has a wire form of its own.
_FIELD_FORMS: dict[type, list[Callable[[Any], Any] | None]] = {}
_NO_DEFAULT = object()
# Per struct, each field's default (or _NO_DEFAULT): trailing fields at their defaults are left off the wire.
_DEFAULTS: dict[type, list[Any]] = {}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NO_DEFAULT


def wire_struct(cls: type) -> type:
    """Make `cls` a dataclass whose fields travel as a positional array, in declaration order.

    Its type hints are resolved in its own module, so every type they name must be defined (or imported)
    above the class there."""
    cls = dataclass(cls)
    hints = typing.get_type_hints(cls)
    _HINTS[cls] = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    _DEFAULTS[cls] = [_field_default(f) for f in dataclasses.fields(cls)]
    _FIELD_FORMS[cls] = [_form_encoder(hint) for _, hint in _HINTS[cls]]
    _ENCODERS[cls] = _struct_encoder(cls)
    return cls


def wire_form(hint: Any, to_wire: Callable[[Any], Any], from_wire: Callable[[Any, str], Any],
              also_encodes: tuple[type, ...] = ()) -> None:
    """Give the field type `hint` (e.g. ``list[PositionLogprobs]``) a wire form of its own: a field declared with
    it, or with it inside ``X | None``, travels as `to_wire(value)` and is decoded by `from_wire(raw, where)`,
    which raises `ProtocolError` naming `where` for a malformed value. `also_encodes`: further Python types that
    `to_wire` takes for such a field (a producer's own accumulator). Register before the structs that use it."""
    _FORMS[hint] = (to_wire, from_wire)
    _FORM_TYPES.update(also_encodes)


def _form_encoder(hint: Any) -> Callable[[Any], Any] | None:
    if hint in _FORMS:
        return _FORMS[hint][0]
    if typing.get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and inner[0] in _FORMS:
            to_wire = _FORMS[inner[0]][0]
            return lambda v: None if v is None else to_wire(v)
    return None


def wire_message(cls: type) -> type:
    """A top-level message: a struct that carries its type name on the wire. Raises `ValueError` for a
    second message of the same name (the name is all the wire says of the type)."""
    if cls.__name__ in MESSAGE_TYPES:
        raise ValueError(f"a protocol message named {cls.__name__} exists already")
    cls = wire_struct(cls)
    MESSAGE_TYPES[cls.__name__] = cls
    return cls


def _default_test(default: Any) -> Callable[[Any], bool]:
    """A test of whether a field's value is its `default`, made once per field: the same type and equal (an empty
    list, dict or array for an empty one; never for a field without a default)."""
    if default is _NO_DEFAULT:
        return lambda v: False
    if default is None:
        return lambda v: v is None
    if type(default) is bool:
        return (lambda v: v is True) if default else (lambda v: v is False)
    if isinstance(default, np.ndarray):
        return (lambda v: isinstance(v, np.ndarray) and v.size == 0) if default.size == 0 else (lambda v: False)
    kind = type(default)
    if isinstance(default, (list, dict)):
        return (lambda v: type(v) is kind and not v) if not default else (lambda v: False)
    return lambda v: type(v) is kind and v == default


def _field_encoder(hint: Any, form: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """How one field's non-scalar value travels: its wire form, else as an array or through `_to_wire`. A field
    declared as a list of scalars (token ids) goes as the list itself, unchecked: msgpack refuses any item
    `_to_wire` would have left as it is."""
    if form is not None:
        return form
    if typing.get_origin(hint) is list and typing.get_args(hint) and typing.get_args(hint)[0] in _SCALARS:
        return lambda v: v if type(v) is list else _array_to_wire(v, hint) if isinstance(v, np.ndarray) \
            else _to_wire(v)
    return lambda v: _array_to_wire(v, hint) if isinstance(v, np.ndarray) else _to_wire(v)


def _struct_encoder(cls: type) -> Callable[[Any], list[Any]]:
    """`cls`'s encoder: its fields in order, without the trailing ones that equal their defaults (the decoder puts
    those back: a field nobody sets costs no byte). Made once per struct, with a test and an encoder per field, so
    that a message of 256 streamed outputs does not redo the per-field decisions for each (1.4 ms before)."""
    names = [name for name, _ in _HINTS[cls]]
    if not names:
        return lambda value: []
    getter = operator.attrgetter(*names)
    get = getter if len(names) > 1 else (lambda value: (getter(value),))
    is_default = [_default_test(d) for d in _DEFAULTS[cls]]
    encoders = [_field_encoder(hint, form) for (_, hint), form in zip(_HINTS[cls], _FIELD_FORMS[cls])]
    scalars = _SCALARS

    def encode_struct(value: Any) -> list[Any]:
        values = get(value)
        end = len(values)
        while end and is_default[end - 1](values[end - 1]):
            end -= 1
        return [v if type(v) in scalars else enc(v) for v, enc in zip(values[:end], encoders)]

    return encode_struct


def _array_to_wire(value: np.ndarray, hint: Any) -> bytes:
    return (f32(value) if hint is Float32Array else i32(value)).tobytes()


def _to_wire(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return i32(value).tobytes()
    encode_struct = _ENCODERS.get(type(value))
    if encode_struct is not None:  # a registered struct (only those can travel)
        return encode_struct(value)
    if isinstance(value, (list, tuple)):
        if all(type(v) in _SCALARS for v in value):  # e.g. 100k prompt token ids: no per-item call
            return value
        return [_to_wire(v) for v in value]
    return value


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})
_ENCODERS: dict[type, Callable[[Any], list[Any]]] = {}  # per struct, `_struct_encoder`


def encode(msg: Any) -> bytes:
    """Encode a message (an instance of a class registered with `wire_message`) to msgpack bytes.

    Raises `TypeError` for anything else, `OverflowError` for an int32 array value outside int32."""
    cls = type(msg)
    if MESSAGE_TYPES.get(cls.__name__) is not cls:
        raise TypeError(f"{cls.__name__} is not a protocol message")
    return msgpack.packb([PROTOCOL_VERSION, cls.__name__, *_to_wire(msg)], use_bin_type=True)


def python_numbers(value: Any) -> Any:
    """`value` with numpy numbers made Python ones (what msgpack and JSON carry): a numpy scalar, a
    numpy array (as a list), or a list or tuple holding numpy scalars (same container type); anything
    else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)) and any(isinstance(v, np.generic) for v in value):
        return type(value)(v.item() if isinstance(v, np.generic) else v for v in value)
    return value


def wire_error(value: Any, where: str = "") -> str | None:
    """Why `value` (a message, a struct or a field value) cannot be encoded, naming the first bad
    part by its path under `where` (e.g. "prompt_token_ids[1]"); None if it can.

    msgpack takes integers in [-2**63, 2**64), text that encodes as UTF-8 (no lone surrogates),
    floats, bytes, None, lists and maps of those, and the int32 arrays of this module.
    """
    if value is None or isinstance(value, (bool, float, bytes, np.ndarray)):
        return None
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return None
        return f"{where} is {value}, which does not fit in 64 bits"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{where} is not valid Unicode text: it holds the lone surrogate {value[exc.start]!r} at index "
                    f"{exc.start}, which has no UTF-8 encoding")
        return None
    if type(value) in _FORM_TYPES:
        return None
    if type(value) in _HINTS:
        for name, _ in _HINTS[type(value)]:
            why = wire_error(getattr(value, name), f"{where}.{name}" if where else name)
            if why is not None:
                return why
        return None
    if isinstance(value, (list, tuple)):
        return next((why for i, v in enumerate(value) if (why := wire_error(v, f"{where}[{i}]")) is not None), None)
    if isinstance(value, dict):
        for k, v in value.items():
            why = wire_error(k, f"{where} key {k!r}") or wire_error(v, f"{where}[{k!r}]")
            if why is not None:
                return why
        return None
    return f"{where} is a {type(value).__name__}, which cannot be sent (use int, float, str, list or dict)"


def decode(data: bytes) -> Any:
    """Decode bytes into a message (an instance of its class in `MESSAGE_TYPES`). Raises `ProtocolError`
    for anything malformed: not msgpack, another version, an unknown type, a missing or mistyped field."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise ProtocolError("a message must be an array [version, type, fields...]")
    version, name, *values = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {quote(version)} (this peer speaks {PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {quote(name)}")
    return _build(cls, values, name)


def _build(cls: type, values: Any, where: str) -> Any:
    """The struct `cls` from its wire fields. The checks compiled for `cls` run first; only a message they
    refuse is checked again field by field, which names the field that is wrong (a path string per field
    made for every message cost more than the rest of decoding: 27 us per token of logprobs)."""
    try:
        return _fast_builder(cls)(values)
    except _Mismatch:
        return _checked_build(cls, values, where)


class _Mismatch(Exception):
    """A compiled check refused a value; the slow checks say why, with the field's path."""


_FAST: dict[Any, Callable[[Any], Any]] = {}


def _fast_builder(cls: type) -> Callable[[Any], Any]:
    build = _FAST.get(cls)
    if build is None:
        names = [name for name, _ in _HINTS[cls]]
        checks = [_fast_check(hint) for _, hint in _HINTS[cls]]

        def build(values: Any) -> Any:
            if type(values) is not list:
                raise _Mismatch
            try:
                return cls(**{name: check(v) for name, check, v in zip(names, checks, values)})
            except TypeError:
                raise _Mismatch from None

        _FAST[cls] = build
    return build


def _fast_check(hint: Any) -> Callable[[Any], Any]:
    """A check of one field against `hint` that converts as `_check` does and raises `_Mismatch` where
    `_check` raises `ProtocolError`."""
    if hint in _FAST and hint not in _HINTS:
        return _FAST[hint]
    origin = typing.get_origin(hint)
    check: Callable[[Any], Any]
    if hint in _FORMS:
        from_wire = _FORMS[hint][1]

        def check(v: Any) -> Any:
            try:
                return from_wire(v, "")
            except ProtocolError:
                raise _Mismatch from None
    elif hint is Any:
        def check(v: Any) -> Any:
            return v
    elif hint is Int32Array or hint is Float32Array:
        dtype = "<i4" if hint is Int32Array else "<f4"

        def check(v: Any) -> Any:
            if type(v) is not bytes or len(v) % 4:
                raise _Mismatch
            return np.frombuffer(v, dtype=dtype)
    elif origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        options = [_fast_check(a) for a in args if a is not type(None)]

        def check(v: Any) -> Any:
            if v is None and optional:
                return None
            for option in options[:-1]:
                try:
                    return option(v)
                except _Mismatch:
                    pass
            return options[-1](v)
    elif origin is list:
        (item,) = typing.get_args(hint)
        item_check = _fast_check(item)
        plain = {item} if item in (int, str) else None

        def check(v: Any) -> Any:
            if type(v) is not list:
                raise _Mismatch
            if plain is not None and set(map(type, v)) <= plain:  # in C: 10 us for 500 token ids, 16 with all()
                return v
            return [item_check(x) for x in v]
    elif origin is dict:
        key_check, value_check = (_fast_check(a) for a in typing.get_args(hint))

        def check(v: Any) -> Any:
            if type(v) is not dict:
                raise _Mismatch
            return {key_check(k): value_check(x) for k, x in v.items()}
    elif hint in _HINTS:
        def check(v: Any) -> Any:
            return _fast_builder(hint)(v)
    elif hint is float:
        def check(v: Any) -> Any:
            if type(v) is float:
                return v
            if type(v) is not int:  # bool is not int here, as in _check
                raise _Mismatch
            return float(v)
    elif hint is int:
        def check(v: Any) -> Any:
            if type(v) is not int:
                raise _Mismatch
            return v
    elif hint in (str, bool, bytes):
        def check(v: Any) -> Any:
            if not isinstance(v, hint):
                raise _Mismatch
            return v
    else:
        def check(v: Any) -> Any:
            return v
    if hint not in _HINTS:
        try:
            _FAST[hint] = check
        except TypeError:  # an unhashable hint: not cached
            pass
    return check


def _checked_build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, list):
        raise ProtocolError(f"{where}: expected an array of fields")
    spec = _HINTS[cls]
    kwargs = {}
    for (name, hint), value in zip(spec, values):  # extra trailing values: a newer peer's fields
        kwargs[name] = _check(hint, value, f"{where}.{name}")
    try:
        return cls(**kwargs)  # missing trailing fields take their defaults
    except TypeError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _check(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint in _FORMS:
        return _FORMS[hint][1](value, where)
    if hint is Any:
        return value
    if hint is Int32Array:
        if not isinstance(value, bytes) or len(value) % 4:
            raise ProtocolError(f"{where}: expected int32 bytes")
        return np.frombuffer(value, dtype="<i4")
    if hint is Float32Array:
        if not isinstance(value, bytes) or len(value) % 4:
            raise ProtocolError(f"{where}: expected float32 bytes")
        return np.frombuffer(value, dtype="<f4")
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner[:-1]:  # the first alternative that fits, in the order written
            try:
                return _check(option, value, where)
            except ProtocolError:
                pass
        return _check(inner[-1], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        if item in (int, str) and all(type(v) is item for v in value):  # the common case, checked in one pass
            return value
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        key_hint, value_hint = typing.get_args(hint)
        return {_check(key_hint, k, f"{where} key"): _check(value_hint, v, f"{where}[{quote(k)}]")
                for k, v in value.items()}
    if hint in _HINTS:
        return _build(hint, value, where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
    if hint in (str, bool, bytes) and not isinstance(value, hint):
        raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
