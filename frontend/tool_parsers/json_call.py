"""One tool call's JSON object, `{"name": ..., "<arguments key>": {...}}`, followed as its text arrives
(`CallScanner`): the name once its string is complete, and where the arguments value lies while it grows. Every
parser of `frontend/tool_parsers/` reads its calls with it."""

from __future__ import annotations

import json

# CallScanner states
_KEY_OR_END, _KEY_NEXT, _KEY, _COLON, _VALUE, _CONTAINER, _STRING, _SCALAR, _AFTER_VALUE = range(9)
_WHITESPACE = " \t\n\r"


class CallScanner:
    """Follows one call's JSON object (`{"name": ..., "<arguments key>": {...}}`) as its text arrives, and finds
    the name and where the arguments value lies. It checks the object's own level (keys, colons, commas, the
    closing brace) and, inside values, only strings and bracket depth: the arguments are checked as JSON once
    complete (`ToolCallRecord.complete`).

    `feed` takes the text from the object's "{" on; it stops at the closing brace (`done`) or at the first
    character that cannot belong to such an object (`failed`), and says how many characters it took.
    """

    def __init__(self, argument_keys: tuple[str, ...]) -> None:
        self.argument_keys = argument_keys
        self.text = ""  # the object's text taken so far, from its "{"
        self.name: str | None = None
        self.arguments_start = -1  # index in `text` of the arguments value, once it began
        self.arguments_end = -1  # index just past it, once it ended
        self.done = False  # the closing brace was taken
        self.failed = False  # a character that cannot continue the object (it was not taken)
        self._state = -1  # before the "{"
        self._key_start = 0
        self._key = ""
        self._value_start = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, chunk: str) -> int:
        """Take characters of `chunk` until the object ends or fails; returns how many were taken."""
        if self.done or self.failed:
            return 0
        base = len(self.text)
        self.text += chunk
        i = base
        text = self.text
        while i < len(text):
            c = text[i]
            state = self._state
            if state == _STRING or (state == _CONTAINER and self._in_string) or state == _KEY:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    if state == _KEY:
                        self._key = json.loads(text[self._key_start: i + 1])
                        self._state = _COLON
                    elif state == _STRING:
                        self._end_value(i + 1)
                    else:
                        self._in_string = False
                i += 1
                continue
            if state == _CONTAINER:
                if c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                elif c in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self._end_value(i + 1)
                elif c == "<":  # never outside a JSON string: a tag the model wrote (an unclosed object)
                    return self._fail(i, base)
                i += 1
                continue
            if state == _SCALAR:
                if c in _WHITESPACE or c in ",}":
                    self._end_value(i)
                    continue  # the character ends the value: read it again after it
                i += 1
                continue
            if c in _WHITESPACE and state != -1:
                i += 1
                continue
            if state == -1:
                if c != "{":
                    return self._fail(i, base)
                self._state = _KEY_OR_END
            elif state in (_KEY_OR_END, _KEY_NEXT):
                if c == '"':
                    self._state, self._key_start = _KEY, i
                elif c == "}" and state == _KEY_OR_END:
                    return self._done(i, base)
                else:
                    return self._fail(i, base)
            elif state == _COLON:
                if c != ":":
                    return self._fail(i, base)
                self._state = _VALUE
            elif state == _VALUE:
                self._value_start = i
                if self._key in self.argument_keys and self.arguments_start < 0:
                    self.arguments_start = i
                if c in "{[":
                    self._state, self._depth = _CONTAINER, 1
                elif c == '"':
                    self._state = _STRING
                elif c in "-0123456789tfn":
                    self._state = _SCALAR
                else:
                    return self._fail(i, base)
            elif state == _AFTER_VALUE:
                if c == ",":
                    self._state = _KEY_NEXT
                elif c == "}":
                    return self._done(i, base)
                else:
                    return self._fail(i, base)
            i += 1
        return len(chunk)

    def _end_value(self, end: int) -> None:
        self._state = _AFTER_VALUE
        if self._key == "name" and self.name is None:
            try:
                name = json.loads(self.text[self._value_start: end])
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self.name = name
        if self._value_start == self.arguments_start:
            self.arguments_end = end

    def _done(self, i: int, base: int) -> int:
        self.done = True
        self.text = self.text[: i + 1]
        return i + 1 - base

    def _fail(self, i: int, base: int) -> int:
        self.failed = True
        self.text = self.text[:i]
        return i - base
