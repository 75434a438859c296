"""Tool calling and reasoning over HTTP with the official `openai` client, against a server started as a user
starts it (`launch.py --http-port ... --tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser
qwen3`) on the tiny random Qwen3 checkpoint (the real Qwen3 tokenizer and chat template).

Random weights write noise, so "required" and a named function, whose grammar forces the calls, must still give
calls valid against the tools' schemas; "auto" is read from a text forced by a regex (the parsers themselves are
tested on crafted texts in tests/test_tools.py); an agent loop sends the call and the tool's result back."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.openai_server import API_KEY, HTTPServer, http_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, for the next days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # Qwen3's template closes the reasoning
THINK_START = 151667  # <think>
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    with http_server(tiny_qwen3, tmp_path_factory.mktemp("http-tools"), "--max-model-len", "1024",
                     "--num-kvcache-blocks", "256", "--served-model-name", "tiny", "--tool-call-parser", "hermes",
                     "--enable-auto-tool-choice", "--reasoning-parser", "qwen3") as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


@pytest.fixture(scope="module")
def client(server: HTTPServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def assert_valid_call(call: object) -> None:
    """An OpenAI tool call of one of TOOLS, whose arguments validate against that tool's parameters schema."""
    assert call.type == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id), call
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(chunks: list) -> tuple[dict[int, dict[str, str]], list[str | None], str]:
    """({index: {id, name, arguments}}, every chunk's finish_reason, the content) of a streamed chat answer,
    checking OpenAI's order: a call's first delta has its id, type and name and empty arguments, the later ones
    only argument pieces."""
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name, piece
                assert piece.function.arguments == ""
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None, piece
                calls[piece.index]["arguments"] += piece.function.arguments
    return calls, [c.choices[0].finish_reason for c in chunks], content


# ---------------------------------------------------------------------------------------------- forced calls
def test_required_gives_one_valid_call_of_the_tools(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=200,
                                            extra_body=NO_THINKING)

    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert_valid_call(call)


def test_required_streams_the_same_call_name_first_then_its_arguments(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=200, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]

    calls, finishes, content = streamed_calls(list(client.chat.completions.create(stream=True, **kwargs)))

    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(whole.function.name, whole.function.arguments)]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None} and content == ""


def test_parallel_calls_are_each_valid(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=5, max_tokens=240, extra_body=NO_THINKING)

    choice = answer.choices[0]
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert_valid_call(call)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    assert choice.finish_reason == ("tool_calls" if choice.message.content is None else "length")


def test_a_named_function_is_called_with_valid_arguments_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120, extra_body=NO_THINKING,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**kwargs).choices[0]

    calls, finishes, _ = streamed_calls(list(client.chat.completions.create(stream=True, **kwargs)))

    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    assert_valid_call(call)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert finishes[-1] == "tool_calls"


def test_without_forcing_the_model_may_open_its_reasoning_before_a_required_call(client: openai.OpenAI) -> None:
    """Qwen3's template leaves the thinking to the model: the grammar allows <think> as the first token; a model
    that does not think (here: <think> banned by logit_bias) is held to the calls from its first token on, and one
    that thinks is not held until </think> (here: never, so its output is all reasoning)."""
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=200)
    direct = client.chat.completions.create(logit_bias={str(THINK_START): -100}, **kwargs).choices[0]
    thinking = client.chat.completions.create(logit_bias={str(THINK_START): 100}, **{**kwargs, "max_tokens": 8})

    assert direct.finish_reason == "tool_calls" and direct.message.model_extra.get("reasoning_content") is None
    assert_valid_call(direct.message.tool_calls[0])
    message = thinking.choices[0].message
    assert thinking.choices[0].finish_reason == "length" and not message.tool_calls and message.content is None
    assert message.model_extra["reasoning_content"]  # the 7 tokens after <think>


def test_reasoning_streams_as_reasoning_content_deltas(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=6, stream=True,
                                                 logit_bias={str(THINK_START): 100}))  # it opens <think>, never ends

    deltas = [c.choices[0].delta for c in chunks]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas[1:-1]]
    assert all(reasoning) and len(reasoning) >= 2 and not any(d.content for d in deltas[1:])
    assert chunks[-1].choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------- auto
def test_auto_reads_the_call_the_model_wrote_whole_and_streamed(client: openai.OpenAI) -> None:
    forced = {**NO_THINKING, "structured_outputs": {"regex": re.escape("Let me check. " + FORCED_CALL)}}
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60, extra_body=forced)

    choice = client.chat.completions.create(**kwargs).choices[0]
    calls, finishes, content = streamed_calls(list(client.chat.completions.create(stream=True, **kwargs)))

    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo", "days": 3})
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert content == "Let me check." and finishes[-1] == "tool_calls"


def test_auto_answers_text_that_is_no_call_as_content(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=12,
                                            extra_body=NO_THINKING).choices[0]

    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"


def test_tool_choice_none_shows_the_tools_but_reads_no_calls(client: openai.OpenAI) -> None:
    forced = {**NO_THINKING, "structured_outputs": {"regex": re.escape(FORCED_CALL)}}
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=60, extra_body=forced).choices[0]

    assert choice.message.content == FORCED_CALL and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


# ---------------------------------------------------------------------------------------------- an agent loop
def test_an_agent_loop_sends_the_call_and_its_result_back_and_gets_an_answer(client: openai.OpenAI,
                                                                             tiny_qwen3: Path) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                           temperature=0, max_tokens=120, extra_body=NO_THINKING)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C."}]

    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=16, extra_body=NO_THINKING)

    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    as_template_sees_it = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}, history[2]]
    prompt = tokenizer.apply_chat_template(as_template_sees_it, tools=TOOLS, add_generation_prompt=True,
                                           tokenize=False, enable_thinking=False)
    assert "<tool_response>\nSunny, 24 C.\n</tool_response>" in prompt
    assert final.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_tokenize_counts_the_prompt_a_chat_request_with_tools_runs(client: openai.OpenAI, server: HTTPServer) -> None:
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=1)
    with_tools = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60).json()
    without = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}, timeout=60).json()

    assert with_tools["count"] == answer.usage.prompt_tokens > without["count"]


# ---------------------------------------------------------------------------------------------- refusals
def chat(server: HTTPServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body},
                      headers=server.headers, timeout=60)


CALL = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "'get_news' is not among the tools ('get_weather', 'get_time')"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "should be 'none', 'auto' or 'required'"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "'get_weather' is the name of tools[0] too"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "Field required"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "not with tool_choice 'required'"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex", "one constraint per request"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [CALL]}]}, "messages",
     "messages[1].tool_calls[0].function.arguments is not JSON text"),
    ({"messages": [*ASK, {"role": "tool", "content": "sunny"}]}, "messages", "tool_call_id is required"),
    ({"messages": [*ASK, {"role": "user", "content": None}]}, "messages", "content is required"),
])
def test_tools_that_cannot_run_are_a_400_naming_the_field(server: HTTPServer, body: dict, param: str,
                                                          message: str) -> None:
    response = chat(server, body)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_parameters_schema_the_grammar_library_refuses_is_a_400_naming_tools(server: HTTPServer) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?=lookahead)"}}}}}
    response = chat(server, {"tools": [bad], "tool_choice": "required", **NO_THINKING})

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and error["message"].startswith("tools: "), error
