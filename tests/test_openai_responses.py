"""OpenAI response bodies and stream chunks built from engine outputs: choice numbering for n > 1, logprobs in
OpenAI's shapes, vLLM's stop_reason and prompt_logprobs, usage over every choice; chat messages and deltas with
reasoning and tool calls."""

from __future__ import annotations

import json
import math

from common.protocol import PositionLogprobs, RequestOutput, SampleOutput, TopLogprob
from frontend.chat_output import ChatOutputReader
from frontend.openai.responses import (
    ChatChunks,
    Choices,
    CompletionChunks,
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    prompt_logprobs,
)
from frontend.reasoning_parsers import get_reasoning_parser
from frontend.tools import ToolChoice

EOS = 99
HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m"}


def position(token: int, text: str, logprob: float, rank: int, top: list[tuple[int, str, float]]) -> PositionLogprobs:
    return PositionLogprobs(token, logprob, rank, text, [TopLogprob(i, lp, t) for i, t, lp in top])


def output(request_id: str, samples: list[SampleOutput], finished: bool = False, prompt_tokens: int = 4,
           **fields: object) -> RequestOutput:
    """A RequestOutput whose `outputs` are `samples` (the first one in the top-level fields)."""
    first, *rest = samples
    return RequestOutput(request_id, first.text, first.token_ids, finished, first.finish_reason,
                         num_prompt_tokens=prompt_tokens, stop_reason=first.stop_reason, logprobs=first.logprobs,
                         cumulative_logprob=first.cumulative_logprob, index=first.index, samples=rest, **fields)


def events(chunks: list[str]) -> list[dict]:
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [json.loads(c[len("data: "):]) for c in chunks]


def test_completion_logprobs_list_the_sampled_token_first_and_offsets_add_up_token_texts() -> None:
    entries = [position(5, "Hel", -0.5, 2, [(6, "He", -0.2), (5, "Hel", -0.5)]),
               position(7, "lo", -float("inf"), 3, [(8, " there", -0.1)])]
    got = completion_logprobs(entries, text_offset=10)
    assert got == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -9999.0],
                   "top_logprobs": [{"Hel": -0.5, "He": -0.2}, {"lo": -9999.0, " there": -0.1}],
                   "text_offset": [10, 13]}
    assert list(got["top_logprobs"][0]) == ["Hel", "He"]  # the sampled token first, then the most likely


def test_chat_logprobs_have_openais_token_logprob_bytes_and_top_list() -> None:
    got = chat_logprobs([position(5, "é", -1.0, 2, [(6, "a", -0.4), (5, "é", -1.0)])])
    assert got == {"content": [{"token": "é", "logprob": -1.0, "bytes": [0xC3, 0xA9],
                                "top_logprobs": [{"token": "a", "logprob": -0.4, "bytes": [97]},
                                                 {"token": "é", "logprob": -1.0, "bytes": [0xC3, 0xA9]}]}],
                   "refusal": None}


def test_prompt_logprobs_are_vllms_dicts_by_token_id_with_the_prompt_token_and_its_rank() -> None:
    got = prompt_logprobs([None, position(11, " cat", -3.0, 7, [(12, " dog", -0.5), (13, " cow", -1.0)])])
    assert got == [None, {"11": {"logprob": -3.0, "rank": 7, "decoded_token": " cat"},
                          "12": {"logprob": -0.5, "rank": 1, "decoded_token": " dog"},
                          "13": {"logprob": -1.0, "rank": 2, "decoded_token": " cow"}}]
    assert prompt_logprobs(None) is None


def test_choices_of_several_prompts_are_numbered_prompt_times_n_plus_sample_and_usage_counts_them_all() -> None:
    choices = Choices(num_prompts=2, n=2, eos_token_id=EOS)
    outs = [output("a", [SampleOutput(0, "x", [1, 2], "length"), SampleOutput(1, "y", [3, 4], "length")], True, 4,
                   num_cached_tokens=2, metrics={"ttft_s": 0.1, "e2e_s": 0.4}),
            output("b", [SampleOutput(0, "z", [5], "stop", "END"), SampleOutput(1, "w", [6, 7, 8], "stop", EOS)],
                   True, 6, metrics={"ttft_s": 0.3, "e2e_s": 0.5})]
    body = completion_response(HEAD, outs, choices)
    assert [(c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == [
        (0, "x", "length", None), (1, "y", "length", None), (2, "z", "stop", "END"), (3, "w", "stop", None)]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (10, 8, 18)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert usage["ttft_s"] == 0.3
    assert math.isclose(usage["tpot_s"], (0.3 / 1 + 0.2 / 2) / 2)  # along each prompt's longest sample
    assert all(c["logprobs"] is None and c["prompt_logprobs"] is None for c in body["choices"])


def test_stop_reason_is_vllms_the_stop_token_id_but_none_at_eos_or_length() -> None:
    choices = Choices(1, 1, eos_token_id=EOS)
    assert choices.stop_reason(SampleOutput(0, finish_reason="stop", stop_reason=EOS)) is None
    assert choices.stop_reason(SampleOutput(0, finish_reason="stop", stop_reason=7)) == 7
    assert choices.stop_reason(SampleOutput(0, finish_reason="stop", stop_reason="\n\n")) == "\n\n"
    assert choices.stop_reason(SampleOutput(0, finish_reason="length")) is None


def test_chat_response_has_a_message_and_logprobs_per_sample_and_prompt_logprobs_on_top() -> None:
    lp = [position(5, "Hi", -0.1, 1, [(5, "Hi", -0.1)])]
    out = output("a", [SampleOutput(0, "Hi", [5], "length", logprobs=lp), SampleOutput(1, "Hi", [5], "length",
                                                                                          logprobs=lp)],
                 True, prompt_logprobs=[None, position(3, "x", -2.0, 4, [])])
    body = chat_response({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m"}, out,
                         Choices(1, 2, EOS))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "Hi", "refusal": None}
    assert body["choices"][1]["logprobs"]["content"][0]["top_logprobs"] == [{"token": "Hi", "logprob": -0.1,
                                                                           "bytes": [72, 105]}]
    assert body["prompt_logprobs"] == [None, {"3": {"logprob": -2.0, "rank": 4, "decoded_token": "x"}}]
    assert body["usage"]["completion_tokens"] == 2


def test_a_completion_stream_interleaves_choices_one_per_chunk_each_ending_once() -> None:
    writer = CompletionChunks(HEAD, Choices(1, 2, EOS), include_usage=True, continuous=False)
    lp = [position(1, "ab", -0.5, 1, [])]
    first = output("a", [SampleOutput(0, "ab", [1], logprobs=lp), SampleOutput(1, "c", [], logprobs=[])])
    chunks = writer.opening([first]) + writer.news(0, first)
    chunks += writer.news(0, output("a", [SampleOutput(1, "d", [3], "stop", "d", logprobs=[])]))
    chunks += writer.news(0, output("a", [SampleOutput(0, "", [4], "length", logprobs=[]),
                                          SampleOutput(1, "late", [9], "stop")], finished=True))
    chunks += writer.closing()
    got = events(chunks)
    assert [[(c["index"], c["text"], c["finish_reason"]) for c in e["choices"]] for e in got] == [
        [(0, "ab", None)], [(1, "c", None)], [(1, "d", None)], [(1, "", "stop")], [(0, "", "length")], []]
    assert got[0]["choices"][0]["logprobs"]["tokens"] == ["ab"]
    assert got[1]["choices"][0]["logprobs"]["tokens"] == []  # text held back before, no new token
    assert got[3]["choices"][0]["stop_reason"] == "d"
    assert all(e["usage"] is None for e in got[:-1])
    assert got[-1]["usage"]["completion_tokens"] == 4  # every token of both choices, the late one included


def test_completion_stream_text_offsets_continue_each_choices_text() -> None:
    writer = CompletionChunks(HEAD, Choices(1, 1, EOS), include_usage=False, continuous=False)
    a = output("a", [SampleOutput(0, "Hello", [1], logprobs=[position(1, "Hello", -1.0, 1, [])])])
    b = output("a", [SampleOutput(0, " you", [2], logprobs=[position(2, " you", -1.0, 1, [])])])
    got = events(writer.news(0, a) + writer.news(0, b))
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in got] == [[0], [5]]
    assert all("usage" not in e for e in got)


def test_a_chat_stream_opens_with_a_role_chunk_per_choice_and_continuous_usage_counts_so_far() -> None:
    writer = ChatChunks({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"},
                        Choices(1, 3, EOS), include_usage=True, continuous=True)
    first = output("a", [SampleOutput(2, "Hi", [1, 2])], prompt_tokens=7)
    got = events(writer.opening([first]) + writer.news(0, first))
    assert [e["choices"][0]["delta"] for e in got] == [{"role": "assistant", "content": ""}] * 3 + [{"content": "Hi"}]
    assert [e["choices"][0]["index"] for e in got] == [0, 1, 2, 2]
    assert got[0]["usage"]["prompt_tokens"] == 7 and got[0]["usage"]["completion_tokens"] == 0
    assert got[-1]["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------------------- reasoning and tools
def qwen3_reader(tools: ToolChoice | None = None):
    return lambda prompt_reasoning: ChatOutputReader(get_reasoning_parser("qwen3"), prompt_reasoning, tools)


THINK_AND_CALL = ["<think>\nWeather", " needs a tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", ",
                  "\"arguments\": {\"city\": \"Par", "is\"}}\n</tool_call>"]


def test_a_chat_response_splits_the_reasoning_and_reads_the_calls_with_the_parsers() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m"}
    out = output("a", [SampleOutput(0, "".join(THINK_AND_CALL), [1, 2, 3], "stop", EOS),
                       SampleOutput(1, "<think>Short.</think>Paris.", [4], "length")], finished=True)

    body = chat_response(head, out, Choices(1, 2, EOS), qwen3_reader(ToolChoice("auto", parser="hermes")))

    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert first["message"]["reasoning_content"] == "Weather needs a tool."
    (call,) = first["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert second["message"] == {"role": "assistant", "content": "Paris.", "refusal": None,
                                 "reasoning_content": "Short."}
    assert second["finish_reason"] == "length"


def test_a_chat_stream_sends_reasoning_deltas_then_the_call_name_then_its_arguments() -> None:
    writer = ChatChunks({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"},
                        Choices(1, 1, EOS), include_usage=False, continuous=False,
                        reader=qwen3_reader(ToolChoice("auto", parser="hermes")))
    outs = [output("a", [SampleOutput(0, text, [i])]) for i, text in enumerate(THINK_AND_CALL[:-1])]
    outs.append(output("a", [SampleOutput(0, THINK_AND_CALL[-1], [9], "stop", EOS)], finished=True))

    got = events(writer.opening(outs[:1]) + [e for out in outs for e in writer.news(0, out)])

    deltas = [e["choices"][0]["delta"] for e in got]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather needs a tool."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert not any("content" in d for d in deltas[1:])
    assert got[-1]["choices"][0]["finish_reason"] == "tool_calls" and deltas[-1] == {}


def test_without_a_reasoning_parser_or_tools_a_chat_answer_is_all_content() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m"}
    out = output("a", [SampleOutput(0, "".join(THINK_AND_CALL), [1], "stop", EOS)], finished=True)

    (choice,) = chat_response(head, out, Choices(1, 1, EOS))["choices"]

    assert choice["message"] == {"role": "assistant", "content": "".join(THINK_AND_CALL), "refusal": None}
    assert choice["finish_reason"] == "stop"


def test_the_prompt_that_closed_the_reasoning_leaves_the_whole_output_to_the_content() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m"}
    out = output("a", [SampleOutput(0, "Paris. <think> is text here.", [1], "stop", EOS)], finished=True,
                 prompt_reasoning=False)  # Qwen3's template with enable_thinking=False

    (choice,) = chat_response(head, out, Choices(1, 1, EOS), qwen3_reader())["choices"]

    assert choice["message"]["content"] == "Paris. <think> is text here." and "reasoning_content" not in \
        choice["message"]


def test_an_engine_refusal_that_names_tools_is_a_400_on_the_tools_field() -> None:
    from common.protocol import ERROR_INVALID_REQUEST
    from frontend.openai.serving import engine_error

    why = "tools: the chat template of this model does not render tools (its text never names `tools`), ..."
    error = engine_error(RequestOutput("a", finished=True, error=why, error_type=ERROR_INVALID_REQUEST), "messages")

    assert (error.status, error.param, error.message) == (400, "tools", why)
