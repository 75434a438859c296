"""Errors whose message is the whole story (logged without a traceback), and how such messages quote
what a client sent."""

from __future__ import annotations

import reprlib


class ExplainedError(RuntimeError):
    """A failure the engine anticipates (a missing device, a stuck step, a silent peer), whose message
    says all a user needs: what went wrong and, where there is one, what to change. A process ending by
    one logs and reports that message alone; any other exception is logged with its traceback.
    `ConfigError` (an unusable model or setting) is taken the same way."""


# Client input quoted in an error reply or a log line is cut to about this many characters: a 50 MiB field
# must not come back as a 50 MiB error, nor fill the log.
QUOTE_CHARS = 200
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = _repr.maxlong = QUOTE_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8
_repr.maxlevel = 3


def quote(value: object) -> str:
    """`repr(value)` of at most about `QUOTE_CHARS` characters (reprlib: long texts keep their two ends,
    long lists their first items), with the full length said when it was cut."""
    text = _repr.repr(value)
    if isinstance(value, (str, bytes)) and len(value) > QUOTE_CHARS:
        text += f" ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    elif isinstance(value, (list, tuple, dict)) and len(value) > _repr.maxlist:
        text += f" ({len(value)} items)"
    return text


def shorten(text: str, limit: int = 4 * QUOTE_CHARS) -> str:
    """`text` if at most `limit` characters, else its two ends with how much was cut between them: for
    messages that may hold client input from elsewhere (an exception raised by a library)."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return f"{text[:head]}... ({len(text) - head - tail} characters cut) ...{text[-tail:]}"
