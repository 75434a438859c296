"""Incremental detokenization: output token ids -> text deltas that never split a character.

Byte-level BPE tokenizers (Qwen, GPT-2, Llama 3, SmolLM2): each token is a run of bytes, so the
output is decoded byte-exactly with Python's incremental UTF-8 decoder, which holds back an
unfinished character until its last byte arrives. Before the first output token, the bytes of
the last few prompt tokens are fed and their text thrown away: a character that straddles the
prompt and the output then comes out whole in the first delta, and no prompt text ever appears
in a delta. The concatenated deltas equal `tokenizer.decode(output_ids)` whenever the output
starts on a character boundary (the usual case).

Other tokenizers (SentencePiece with byte fallback, ...) use `tokenizers.decoders.DecodeStream`,
Hugging Face's own streaming decoder, started after the prompt.
"""

from __future__ import annotations

import codecs
from typing import Any

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT_TOKENS = 4  # a UTF-8 character has at most 4 bytes, each token at least 1


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class _TokenBytes:
    """Token id -> its bytes, for one byte-level tokenizer (cached; special tokens can be skipped)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.cache: dict[int, bytes] = {}
        self.texts: dict[int, str | None] = {}  # token id -> its text when its bytes are whole UTF-8 characters

    def whole_text(self, token_id: int) -> str | None:
        """The text of a token whose bytes are complete, valid UTF-8 (most of a vocabulary), else None. Not for a
        special token that is skipped (`__call__` gives it no bytes)."""
        try:
            return self.texts[token_id]
        except KeyError:
            try:
                text: str | None = self(token_id, False).decode()
            except UnicodeDecodeError:
                text = None
            self.texts[token_id] = text
            return text

    def __call__(self, token_id: int, skip_special: bool) -> bytes:
        if skip_special and token_id in self.special:
            return b""
        data = self.cache.get(token_id)
        if data is None:
            token = self.backend.id_to_token(token_id)  # None for an id outside the vocabulary
            data = b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode() for c in token or "")
            self.cache[token_id] = data
        return data


_TABLES: dict[int, _TokenBytes] = {}


def token_bytes_table(tokenizer: Any) -> _TokenBytes | None:
    """The byte table of a byte-level tokenizer, or None for any other kind."""
    backend = tokenizer.backend_tokenizer
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    table = _TABLES.get(id(backend))
    if table is None or table.backend is not backend:
        table = _TABLES[id(backend)] = _TokenBytes(backend)
    return table


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        """`tokenizer`: a transformers fast tokenizer; `prompt_token_ids`: the request's prompt."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._bytes = token_bytes_table(tokenizer)
        self._pieces: list[str] = []  # everything emitted so far
        self.token_ids: list[int] = []
        if self._bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
            self._utf8.decode(b"".join(self._bytes(t, skip_special_tokens) for t in context))  # text dropped
            # Whether the UTF-8 decoder holds the first bytes of a character: while it does not, a token made of
            # whole characters is its cached text (`whole_text`), without a call into the decoder.
            self._partial = bool(self._utf8.getstate()[0])
        else:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._backend = tokenizer.backend_tokenizer

    def step(self, token_id: int, emit: bool = True) -> str:
        """Add one output token; return the new text it completes ("" while a character is partial).
        With `emit` False the token is recorded but its text left out (a stop token's)."""
        self.token_ids.append(token_id)
        if not emit:
            return ""
        table = self._bytes
        if table is None:
            piece = self._stream.step(self._backend, token_id) or ""
        elif self._skip_special and token_id in table.special:
            piece = ""
        else:
            whole = None if self._partial else table.whole_text(token_id)
            if whole is not None:
                piece = whole
            else:
                piece = self._utf8.decode(table(token_id, self._skip_special))
                self._partial = bool(self._utf8.getstate()[0])
        self._pieces.append(piece)
        return piece

    def steps(self, token_ids: list[int], emit_last: bool = True) -> str:
        """`step` for each of `token_ids` in turn (the last one's text left out unless `emit_last`), as one string.
        A byte-level tokenizer's tokens are decoded in one call: the UTF-8 decoder gives the same text for the
        bytes fed at once as token by token (`tests/test_outputs.py` checks it)."""
        if not token_ids:
            return ""
        table = self._bytes
        if table is None:
            last = len(token_ids) - 1
            return "".join([self.step(t, emit_last or i < last) for i, t in enumerate(token_ids)])
        self.token_ids.extend(token_ids)
        skip = self._skip_special
        data = b"".join([table(t, skip) for t in (token_ids if emit_last else token_ids[:-1])])
        piece = self._utf8.decode(data)
        self._partial = bool(self._utf8.getstate()[0])
        self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def flush(self) -> str:
        """At the end of the output: an unfinished character, shown as U+FFFD like `decode()` shows it."""
        if self._bytes is None:
            return ""
        tail = self._utf8.decode(b"", final=True)
        self._partial = False
        self._pieces.append(tail)
        return tail
