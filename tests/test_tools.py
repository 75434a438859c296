"""Tool calling and reasoning without an engine: the tool-call and reasoning parsers on crafted model outputs
(well-formed calls, several calls, text around them, truncated and invalid ones; every stream, fed in any pieces,
adds up to the whole answer), the tool_choice rules and grammars, and the chat template's rendering of tools and of
a history of calls (the frontend's, on the real Qwen3 tokenizer)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from common.protocol import GenerateRequest
from frontend.chat_output import ChatOutputReader, read_chat_output
from frontend.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from frontend.tool_parsers import TOOL_PARSER_NAMES, ToolCallDelta, get_tool_parser, parse_with, tool_parsers
from frontend.tool_parsers.forced import NamedCallStream, RequiredCallsStream
from frontend.tools import ToolChoice, ToolRequestError, resolve_tool_choice, tool_constraint
from frontend.validation import encode_prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, '
                    '{"x": "}]"}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def calls_of(parsed) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def pieces(text: str, seed: int) -> list[str]:
    """`text` cut at random places (seeded), into pieces of 1 to 6 characters."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i: i + n])
        i += n
    return out


def streamed(stream, chunks: list[str]) -> tuple[str, dict[int, dict[str, str]]]:
    """(content, {index: {"id", "name", "arguments"}}) a stream gives out over `chunks`."""
    events = [e for chunk in chunks for e in stream.feed(chunk)] + stream.finish()
    calls: dict[int, dict[str, str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index not in calls and e.index == len(calls) and e.arguments == ""
                calls[e.index] = {"id": e.id, "name": e.name, "arguments": ""}
            else:
                calls[e.index]["arguments"] += e.arguments
    return "".join(e for e in events if isinstance(e, str)), calls


# ---------------------------------------------------------------------------------------------- hermes
def test_hermes_reads_two_calls_and_keeps_the_text_before_them_as_content() -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_TWO_CALLS)

    assert parsed.content == "Let me look."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "days": [1, {"x": "}]"}]}), ("get_time", {})]
    assert parsed.calls[0].id.startswith("chatcmpl-tool-") and parsed.calls[0].id != parsed.calls[1].id
    assert parsed.calls[0].arguments == '{"city": "Paris", "days": [1, {"x": "}]"}]}'  # as the model wrote it


def test_hermes_output_without_a_call_is_all_content() -> None:
    parsed = get_tool_parser("hermes").parse("Paris is sunny.\n")

    assert parsed.content == "Paris is sunny.\n" and parsed.calls == []


@pytest.mark.parametrize(("text", "content", "calls"), [
    # cut by max_tokens inside the arguments: no call, the text stays
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', []),
    # not JSON, or no name: the block is text
    ("<tool_call>\nget_weather(Paris)\n</tool_call> done", "<tool_call>\nget_weather(Paris)\n</tool_call> done", []),
    ('<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', []),
    # the object's closing brace is missing, but its arguments are whole: a call
    ('x <tool_call>\n{"name": "get_time", "arguments": {}\n</tool_call> y', "x y", [("get_time", {})]),
    # arguments left unclosed before the end tag: the call is text
    ('<tool_call>{"name": "get_time", "arguments": {"a": 1</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {"a": 1</tool_call>', []),
    # no arguments key: {}; "parameters" is taken for "arguments"; text after the last call
    ('<tool_call>{"name": "get_time"}</tool_call>', "", [("get_time", {})]),
    ('<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>\nAnd more.',
     "\nAnd more.", [("get_weather", {"city": "Oslo"})]),
    # a tag cut at the end is text
    ("See <tool_ca", "See <tool_ca", []),
])
def test_hermes_truncated_invalid_and_partial_outputs(text: str, content: str, calls: list) -> None:
    parsed = get_tool_parser("hermes").parse(text)

    assert (parsed.content, calls_of(parsed)) == (content, calls)


# ---------------------------------------------------------------------------------------------- llama3_json
@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (' {"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    ('{"name": "get_time", "parameters": {}} Done.', "Done.", [("get_time", {})]),
    ('{"name": "get_weather", "parameters": {"city": "Pa', '{"name": "get_weather", "parameters": {"city": "Pa', []),
])
def test_llama3_json_reads_calls_separated_by_semicolons(text: str, content: str, calls: list) -> None:
    parsed = get_tool_parser("llama3_json").parse(text)

    assert (parsed.content, calls_of(parsed)) == (content, calls)


def test_the_registry_names_every_parser_by_its_vllm_name() -> None:
    assert sorted(tool_parsers()) == sorted(TOOL_PARSER_NAMES) == ["hermes", "llama3_json"]
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")


# ---------------------------------------------------------------------------------------------- streams
STREAM_CASES = [
    ("hermes", HERMES_TWO_CALLS),
    ("hermes", "No call at all, just words.  "),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'),
    ("llama3_json", '{"answer": 42}'),
]


@pytest.mark.parametrize(("parser", "text"), STREAM_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stream_in_any_pieces_gives_the_whole_answer(parser: str, text: str, seed: int) -> None:
    whole = get_tool_parser(parser).parse(text)

    content, calls = streamed(get_tool_parser(parser).stream(), pieces(text, seed))

    complete = [c for c in calls.values() if _is_object(c["arguments"])]
    assert [(c["name"], c["arguments"]) for c in complete] == [(c.name, c.arguments) for c in whole.calls]
    unfinished = "".join(text[text.rfind("<tool_call>"):] for c in calls.values() if not _is_object(c["arguments"]))
    assert content + unfinished == whole.content


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_a_call_streams_its_name_first_then_its_arguments_as_they_grow() -> None:
    stream = get_tool_parser("hermes").stream()
    events = []
    for chunk in ["<tool_call>\n{\"name\": \"get_", "weather\", \"arguments\": {\"ci", "ty\": \"Par", "is\"}}\n</tool",
                  "_call>"]:
        events.append(stream.feed(chunk))
    events.append(stream.finish())

    assert events[0] == []  # the name is not complete yet
    assert [(e.index, e.name, e.arguments) for e in events[1]] == [(0, "get_weather", ""), (0, None, '{"ci')]
    assert [e.arguments for e in events[2]] == ['ty": "Par']
    assert [e.arguments for e in events[3]] == ['is"}']
    assert events[4] == []


# ---------------------------------------------------------------------------------------------- forced calls
def test_required_calls_are_read_from_the_json_array_the_grammar_forces() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'

    parsed = parse_with(RequiredCallsStream(), text)
    content, calls = streamed(RequiredCallsStream(), pieces(text, 3))

    assert parsed.content == "" and calls_of(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in parsed.calls]


def test_a_named_function_call_is_the_whole_output() -> None:
    parsed = parse_with(NamedCallStream("get_weather"), '  {"city": "Paris"}\n')
    content, calls = streamed(NamedCallStream("get_weather"), pieces('  {"city": "Paris"}\n', 5))

    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})] and parsed.content == ""
    assert list(calls.values())[0]["arguments"] == parsed.calls[0].arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("parallel", [True, False])
def test_the_required_grammar_admits_calls_of_the_tools_only(parallel: bool) -> None:
    schema = tool_constraint([WEATHER, TIME], ToolChoice("required", parallel=parallel))["json"]
    one = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    two = one + [{"name": "get_time", "parameters": {}}]

    jsonschema.validate(one, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)


def test_a_named_function_grammar_is_its_parameters_schema() -> None:
    choice = ToolChoice("function", function="get_weather")

    assert tool_constraint([WEATHER, TIME], choice) == {"json": WEATHER["function"]["parameters"]}
    assert tool_constraint([WEATHER, TIME], ToolChoice("function", function="get_time")) == {
        "json": {"type": "object", "properties": {}}}
    assert tool_constraint([WEATHER], ToolChoice("auto", parser="hermes")) is None


# ---------------------------------------------------------------------------------------------- tool_choice rules
def resolve(tools: list | None, choice: object, parser: str | None = "hermes", auto: bool = True) -> ToolChoice | None:
    return resolve_tool_choice(tools, choice, None, parser, auto, "--enable-auto-tool-choice")


def test_tool_choice_defaults_to_auto_with_tools_and_to_nothing_without() -> None:
    assert resolve([WEATHER], None) == ToolChoice("auto", parser="hermes")
    assert resolve(None, None) is None and resolve([], "none") is None
    assert resolve([WEATHER], "none") == ToolChoice("none")
    assert resolve([WEATHER], {"type": "function", "function": {"name": "get_weather"}}) == ToolChoice(
        "function", function="get_weather")
    assert resolve_tool_choice([WEATHER], "required", False, None, False, "").parallel is False


@pytest.mark.parametrize("value", ["no", 0, 1, "false"])
def test_a_parallel_tool_calls_that_is_not_a_bool_is_refused_naming_it(value: object) -> None:
    """LLM.chat took "no" as true (the HTTP schema refused it already; a fresh user's trial)."""
    with pytest.raises(ToolRequestError, match="parallel_tool_calls must be true, false or null") as info:
        resolve_tool_choice([WEATHER], "required", value, None, False, "")  # type: ignore[arg-type]
    assert info.value.param == "parallel_tool_calls"


@pytest.mark.parametrize(("tools", "choice", "parser", "message"), [
    ([WEATHER], "auto", None, '"auto".*--enable-auto-tool-choice'),
    ([WEATHER], None, None, '"auto".*--enable-auto-tool-choice'),
    (None, "required", "hermes", "needs tools"),
    ([WEATHER], "sometimes", "hermes", "must be one of none, auto, required"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "hermes", "'get_time' is not among"),
    ([WEATHER], {"name": "get_weather"}, "hermes", "a named function is"),
    ([WEATHER, WEATHER], "required", "hermes", r"tools\[1\].function.name: 'get_weather' is the name of tools\[0\]"),
    ([{"type": "function", "function": {"name": ""}}], "required", "hermes", "non-empty string"),
])
def test_tool_choice_that_cannot_run_is_refused_naming_the_field(tools: list | None, choice: object,
                                                                 parser: str | None, message: str) -> None:
    with pytest.raises(ToolRequestError, match=message) as refused:
        resolve(tools, choice, parser)
    assert refused.value.param in ("tools", "tool_choice") and str(refused.value).startswith(refused.value.param)


# ---------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize(("parser", "prompt_reasoning", "text", "reasoning", "content"), [
    ("qwen3", None, "<think>\nThe user asks.\n</think>\n\nParis.", "The user asks.", "Paris."),
    ("qwen3", None, "Paris.", None, "Paris."),  # no <think>: all content
    ("qwen3", None, "  <think>Cut off before the end", "Cut off before the end", ""),
    ("qwen3", None, "<thin", None, "<thin"),
    ("qwen3", True, "Thinking in the prompt's block.</think>\n\nParis.", "Thinking in the prompt's block.", "Paris."),
    ("qwen3", False, "Paris, <think> is just text here.", None, "Paris, <think> is just text here."),
    ("deepseek_r1", None, "No start tag.</think>Paris.", "No start tag.", "Paris."),
    ("deepseek_r1", None, "<think>With one.</think>Paris.", "With one.", "Paris."),
    ("deepseek_r1", None, "Never ended", "Never ended", ""),
    ("deepseek_r1", False, "Paris.", None, "Paris."),
    ("qwen3", None, "<think>\n\n</think>\n\nParis.", None, "Paris."),  # an empty block: no reasoning
])
@pytest.mark.parametrize("seed", [None, 4])
def test_reasoning_is_split_from_the_answer_whole_and_streamed(parser: str, prompt_reasoning: bool | None, text: str,
                                                               reasoning: str | None, content: str,
                                                               seed: int | None) -> None:
    p = get_reasoning_parser(parser)
    if seed is None:
        assert p.split(text, prompt_reasoning) == (reasoning, content)
        return
    stream = p.stream(prompt_reasoning)
    parts = [stream.feed(chunk) for chunk in pieces(text, seed)] + [stream.finish()]
    assert "".join(r for r, _ in parts) == (reasoning or "") and "".join(c for _, c in parts) == content


def test_the_engine_config_names_every_reasoning_parser() -> None:
    from common.config import REASONING_PARSERS as CONFIG_NAMES

    assert sorted(REASONING_PARSERS) == sorted(CONFIG_NAMES) == ["deepseek_r1", "qwen3"]


def test_the_prompt_tail_says_where_the_output_starts() -> None:
    qwen3 = REASONING_PARSERS["qwen3"]

    assert qwen3.prompt_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False  # enable_thinking=False
    assert qwen3.prompt_reasoning("<|im_start|>assistant\n<think>\n") is True  # Qwen3-Thinking-2507
    assert qwen3.prompt_reasoning("<|im_start|>assistant\n") is None


# ---------------------------------------------------------------------------------------------- the whole message
def test_reasoning_then_a_call_make_one_message_and_its_stream_adds_up_to_it() -> None:
    text = '<think>\nWeather needs a call.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call>'
    tools = ToolChoice("auto", parser="hermes")
    qwen3 = get_reasoning_parser("qwen3")

    whole = read_chat_output(text, qwen3, None, tools)
    reader = ChatOutputReader(qwen3, None, tools)
    deltas = [d for chunk in pieces(text, 7) for d in reader.feed(chunk)] + reader.finish()

    assert whole.to_openai() | {"tool_calls": None} == {"role": "assistant", "content": None, "refusal": None,
                                                         "reasoning_content": "Weather needs a call.",
                                                         "tool_calls": None}
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather needs a call."
    assert not any("content" in d for d in deltas)
    first = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["type"] == "function"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d) == \
        '{"city": "Paris"}'


def test_without_parallel_calls_only_the_first_call_is_returned() -> None:
    message = read_chat_output(HERMES_TWO_CALLS, tools=ToolChoice("auto", parallel=False, parser="hermes"))

    assert [c.name for c in message.tool_calls] == ["get_weather"] and message.content == "Let me look."


# ---------------------------------------------------------------------------------------------- the chat template
SMOLLM2_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")  # the demo model's: it never names tools


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


def chat_request(messages: list[dict], tools: list | None = None, **kwargs: object) -> GenerateRequest:
    return GenerateRequest("r", messages=messages, tools=tools, **kwargs)


def rendered(tokenizer, messages: list[dict], tools: list) -> list[int]:
    """The token ids transformers' own rendering gives."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tools_reach_the_model_through_the_templates_own_rendering(tokenizer) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    ids = encode_prompt(tokenizer, chat_request(messages, [WEATHER]))

    text = tokenizer.decode(ids)
    assert "# Tools" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    assert ids == rendered(tokenizer, messages, [WEATHER])


def test_a_template_that_renders_no_tools_refuses_them_naming_tools(tokenizer) -> None:
    plain = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    plain.chat_template = SMOLLM2_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}]

    with pytest.raises(ValueError, match=r"^tools: the chat template of this model does not render tools"):
        encode_prompt(plain, chat_request(messages, [WEATHER]))
    assert encode_prompt(plain, chat_request(messages, []))  # an empty list: no tools
    with pytest.raises(ValueError, match="^tools: only a chat request"):
        encode_prompt(tokenizer, GenerateRequest("r", prompt="Hi", tools=[WEATHER]))


def test_a_history_of_calls_and_tool_results_renders_with_the_arguments_as_objects(tokenizer) -> None:
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}]

    ids = encode_prompt(tokenizer, chat_request(messages, [WEATHER]))

    as_objects = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]]
    assert ids == rendered(tokenizer, as_objects, [WEATHER])
    text = tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert messages[1]["content"] is None  # the request's own messages are left as they were


@pytest.mark.parametrize(("arguments", "message"), [
    ("{not json", r"messages\[1\].tool_calls\[0\].function.arguments is not JSON text"),
    ('["a"]', r"messages\[1\].tool_calls\[0\].function.arguments must be a JSON object"),
    # 5,000 levels overflowed Python's stack: an internal error and a traceback (a fresh user's trial)
    ('{"x":' * 5000 + "1" + "}" * 5000, r"messages\[1\].tool_calls\[0\].function.arguments is JSON nested too"),
])
def test_call_arguments_that_are_no_json_object_are_refused_naming_them(tokenizer, arguments: str,
                                                                        message: str) -> None:
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                      "function": {"name": "get_weather", "arguments": arguments}}]}]
    with pytest.raises(ValueError, match=message):
        encode_prompt(tokenizer, chat_request(messages, [WEATHER]))
