"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` mean (OpenAI's fields, vLLM's rules): which
mode the request runs in, the grammar that enforces a forced call, and the reader of its output.

- `"none"`: the model sees the tools (the chat template renders them) and answers in text; all of it is content.
- `"auto"` (the default with tools): the model decides; its output is read by a tool-call parser
  (`--tool-call-parser`, which the HTTP server allows only with `--enable-auto-tool-choice`).
- `"required"`: the model must call one or more of them: a grammar allows only a JSON array of `{"name": <one of
  the tools>, "parameters": <its parameters schema>}` objects, at least one (at most one with
  `parallel_tool_calls: false`), read by `forced.RequiredCallsStream`.
- `{"type": "function", "function": {"name": N}}`: the model must call N: a grammar allows only N's arguments
  object, read by `forced.NamedCallStream`.

A forced call needs no parser, and is refused beside another structured-output constraint (`response_format`, ...):
the output can follow only one grammar. With `"auto"` and `parallel_tool_calls: false`, only the first call the
model writes is returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from frontend.tool_parsers import ToolCallStream, get_tool_parser
from frontend.tool_parsers.forced import NamedCallStream, RequiredCallsStream

TOOL_CHOICE_MODES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}  # a tool that declares no parameters takes none


class ToolRequestError(ValueError):
    """A request's tools or tool_choice cannot run; `param` is the request field to blame (the message starts with
    it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """How one request uses its tools: `mode` "none", "auto", "required" or "function" (a named one, `function`),
    `parallel`: whether several calls may be returned, `parser`: the tool-call parser of mode "auto"."""

    mode: str
    function: str | None = None
    parallel: bool = True
    parser: str | None = None

    def stream(self) -> ToolCallStream | None:
        """A reader of one output of this request (None in mode "none": all of it is content)."""
        if self.mode == "auto":
            assert self.parser is not None
            return get_tool_parser(self.parser).stream()
        if self.mode == "required":
            return RequiredCallsStream()
        if self.mode == "function":
            assert self.function is not None
            return NamedCallStream(self.function)
        return None

    @property
    def forced(self) -> bool:
        """The grammar forces calls ("required" or a named function)."""
        return self.mode in ("required", "function")


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The function names of `tools` (OpenAI's `[{"type": "function", "function": {"name", ...}}]`), in order.
    Raises `ToolRequestError` naming `tools[i]` for a tool of another shape or a name given twice."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ToolRequestError("tools", f"tools must be a list of tools, got {type(tools).__name__}")
    names: list[str] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ToolRequestError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                            f"'parameters': ...}}}}, got {str(tool)[:80]}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError("tools", f"tools[{i}].function.name must be a non-empty string, got {name!r}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ToolRequestError("tools", f"tools[{i}].function.parameters must be a JSON schema (an object), got "
                                            f"{str(parameters)[:80]}")
        if name in names:
            raise ToolRequestError("tools", f"tools[{i}].function.name: {name!r} is the name of tools"
                                            f"[{names.index(name)}] too: each tool needs its own name")
        names.append(name)
    return names


def resolve_tool_choice(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
                        parallel_tool_calls: bool | None, parser: str | None, auto_allowed: bool,
                        auto_hint: str) -> ToolChoice | None:
    """The `ToolChoice` of a request, or None when it has no tools (None or empty) and a `tool_choice` of None or
    "none". `tool_choice` None means "auto" (OpenAI's default with tools). `parser`: the tool-call parser mode
    "auto" reads with; `auto_allowed`: whether this server allows mode "auto" at all (vLLM's
    --enable-auto-tool-choice); `auto_hint`: how to enable it, for the error message.

    Raises `ToolRequestError` naming the field: a tool_choice without tools, an unknown mode, a named function
    that is not among the tools, "auto" without a parser or where it is not allowed, a malformed tool, a
    parallel_tool_calls that is not a bool or None."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolRequestError("parallel_tool_calls", f"parallel_tool_calls must be true, false or null, got "
                                                      f"{_shown(parallel_tool_calls)}")
    if not tools:
        if tool_choice is None or tool_choice == "none":
            return None
        raise ToolRequestError("tool_choice", f"tool_choice: {_shown(tool_choice)} needs tools (none were given)")
    names = tool_names(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise ToolRequestError("tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                                                  f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                                                  f"{tool_choice!r}")
        if tool_choice == "auto" and (parser is None or not auto_allowed):
            raise ToolRequestError("tool_choice", f'tool_choice: "auto" (the default when tools are given) needs '
                                                  f"{auto_hint}; or choose \"none\", \"required\" or a named "
                                                  "function, which need no parser")
        return ToolChoice(tool_choice, parallel=parallel, parser=parser if tool_choice == "auto" else None)
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolRequestError("tool_choice", "tool_choice: a named function is {'type': 'function', 'function': "
                                              f"{{'name': ...}}}}, got {_shown(tool_choice)}")
    if name not in names:
        raise ToolRequestError("tool_choice", f"tool_choice: the function {name!r} is not among the tools "
                                              f"({', '.join(repr(n) for n in names)})")
    return ToolChoice("function", function=name, parallel=parallel)


def tool_constraint(tools: Sequence[Mapping[str, Any]], choice: ToolChoice) -> dict[str, Any] | None:
    """The `structured_outputs` value (`{"json": schema}`) that enforces a forced call, or None for the other modes.

    "required": an array of 1 (to 1 with `parallel` False, else unbounded) objects, each `{"name": N,
    "parameters": N's parameters schema}` for one of the tools N (an `anyOf` over the tools, as vLLM builds it);
    a named function: that function's parameters schema. A tool without `parameters` takes `{}` only."""
    if not choice.forced:
        return None
    parameters = {t["function"]["name"]: dict(t["function"].get("parameters") or NO_PARAMETERS) for t in tools}
    if choice.mode == "function":
        assert choice.function is not None
        return {"json": parameters[choice.function]}
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"]} for name, schema in parameters.items()]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not choice.parallel:
        array["maxItems"] = 1
    return {"json": array}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
