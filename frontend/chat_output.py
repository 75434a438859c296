"""A chat sample's output text as OpenAI's assistant message: its reasoning (`reasoning_content`, with a reasoning
parser), its `content`, and its `tool_calls` (with tools), whole or delta by delta.

The text goes through the reasoning parser first (`frontend/reasoning_parsers.py`); what is not reasoning goes
through the reader of the request's tool choice (`frontend/tools.py`: a tool-call parser for "auto", the forced
readers for "required" and a named function), and what is not a call is content. The HTTP server (whole answers
and streams) and `LLM.chat` (whole answers) read outputs through here, so they agree.

Streamed deltas take OpenAI's shapes: `{"reasoning_content": text}`, `{"content": text}`, and for call i first
`{"tool_calls": [{"index": i, "id", "type": "function", "function": {"name", "arguments": ""}}]}`, then
`{"tool_calls": [{"index": i, "function": {"arguments": more}}]}` as its arguments grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.reasoning_parsers import ReasoningParser
from frontend.tool_parsers import ToolCall, ToolCallDelta
from frontend.tools import ToolChoice


@dataclass
class AssistantMessage:
    """An output read whole: `content` (None when a call or reasoning took all of it), `reasoning_content` (None
    without reasoning) and the `tool_calls`."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's `message` object; `reasoning_content` and `tool_calls` appear only when there are some."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content, "refusal": None}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" for an output that made calls and stopped by itself, else the
        engine's."""
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason


class ChatOutputReader:
    """One sample's output read as it arrives: `feed` each text delta (OpenAI's deltas come back), then `finish`;
    `message()` is then the whole answer, the same a non-streamed request gets.

    `reasoning`: the engine's reasoning parser (None: no reasoning); `prompt_reasoning`: where the prompt left the
    reasoning (`RequestOutput.prompt_reasoning`); `tools`: the request's tool choice (None: no tools)."""

    def __init__(self, reasoning: ReasoningParser | None = None, prompt_reasoning: bool | None = None,
                 tools: ToolChoice | None = None) -> None:
        self._reasoning = reasoning.stream(prompt_reasoning) if reasoning is not None else None
        self._tools = tools.stream() if tools is not None else None
        self._max_calls = None if tools is None or tools.parallel else 1
        self._reasoning_parts: list[str] = []
        self._content_parts: list[str] = []

    @property
    def num_calls(self) -> int:
        """Calls streamed so far."""
        if self._tools is None:
            return 0
        return min(self._tools.num_calls, self._max_calls or self._tools.num_calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The OpenAI deltas of the next text delta of the output, in order (consecutive pieces of one kind
        merged)."""
        if self._reasoning is None:
            return self._answer(text)
        reasoning, content = self._reasoning.feed(text)
        return self._deltas(reasoning, content)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was still held when the output ended."""
        deltas = []
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
            deltas = self._deltas(reasoning, content)
        if self._tools is not None:
            deltas += self._merge(self._tools.finish())
        return deltas

    def message(self) -> AssistantMessage:
        """The whole answer (call after `finish`)."""
        reasoning = "".join(self._reasoning_parts)
        reasoned = self._reasoning is not None and self._reasoning.reasoned and reasoning
        content = "".join(self._content_parts)
        calls: list[ToolCall] = []
        if self._tools is not None:
            records = self._tools.records[: self._max_calls]
            calls = [r.tool_call() for r in records if r.complete]
            content += "".join(r.raw for r in records if not r.complete)
        return AssistantMessage(content or (None if calls or reasoned else ""), reasoning if reasoned else None, calls)

    def _deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        deltas = []
        if reasoning:
            self._reasoning_parts.append(reasoning)
            deltas.append({"reasoning_content": reasoning})
        return deltas + (self._answer(content) if content else [])

    def _answer(self, text: str) -> list[dict[str, Any]]:
        if self._tools is None:
            if not text:
                return []
            self._content_parts.append(text)
            return [{"content": text}]
        return self._merge(self._tools.feed(text))

    def _merge(self, events: list[str | ToolCallDelta]) -> list[dict[str, Any]]:
        """OpenAI deltas from a tool reader's events: content runs joined, a call's argument pieces joined, calls
        beyond `_max_calls` left out."""
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, str):
                self._content_parts.append(event)
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += event
                else:
                    deltas.append({"content": event})
                continue
            if self._max_calls is not None and event.index >= self._max_calls:
                continue
            if event.id is not None:
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
                continue
            last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
            if last is not None and last["index"] == event.index and "id" not in last:
                last["function"]["arguments"] += event.arguments
            else:
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
        return deltas


def read_chat_output(text: str, reasoning: ReasoningParser | None = None, prompt_reasoning: bool | None = None,
                     tools: ToolChoice | None = None) -> AssistantMessage:
    """A whole output as OpenAI's assistant message (see `ChatOutputReader`)."""
    reader = ChatOutputReader(reasoning, prompt_reasoning, tools)
    reader.feed(text)
    reader.finish()
    return reader.message()
