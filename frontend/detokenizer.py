"""Incremental detokenization: output token ids -> text deltas that never split a character.

Built on `tokenizers.decoders.DecodeStream` (Hugging Face tokenizers >= 0.21), which holds back
bytes until they form whole UTF-8 characters, so a character spread over several byte-level
BPE tokens (CJK, emoji) is emitted once, complete. The stream starts from the last few prompt
tokens as context, so a character that straddles the prompt and the output comes out whole in
the first delta, and no prompt text ever appears in a delta.

(`DecodeStream(ids=context)` alone leaks the context's text into the first delta when the context
ends inside a character, so such trailing context tokens are fed through `step` instead.)
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT_TOKENS = 6  # enough to hold any partial UTF-8 character (at most 4 bytes)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        """`tokenizer`: a transformers fast tokenizer (its Rust `backend_tokenizer` is used)."""
        self._backend = tokenizer.backend_tokenizer
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        whole = len(context)  # the longest context prefix that decodes to whole characters
        while whole and tokenizer.decode(context[:whole], skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            whole -= 1
        self._stream = DecodeStream(ids=context[:whole], skip_special_tokens=skip_special_tokens) if whole else \
            DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context[whole:]:
            self._stream.step(self._backend, token_id)  # bytes of an unfinished character: no text yet
        self.text = ""  # everything emitted so far
        self.token_ids: list[int] = []

    def step(self, token_id: int) -> str:
        """Add one output token; return the new text it completes ("" while a character is partial)."""
        self.token_ids.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return ""
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of the output: bytes still held back (an unfinished character) as decode() shows them."""
        full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special)
        if full.startswith(self.text) and len(full) > len(self.text):
            tail = full[len(self.text):]
            self.text = full
            return tail
        return ""
