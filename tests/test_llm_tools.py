"""Reasoning and tool calls through the whole engine and the offline API (`LLM.chat(..., tools=...)`), on a tiny
Qwen3 checkpoint that writes fixed texts (the real Qwen3 tokenizer and chat template): a model that thinks, then
calls a tool in Qwen3's format, and answers in words once the reasoning is closed in its prompt. So the output is
known token for token, and what the parsers and the grammar do with it can be asserted exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams

THINK_START, THINK_END, CALL_START, CALL_END, IM_END = 151667, 151668, 151657, 151658, 151645
# The last prompt token: Qwen3's "<|im_start|>assistant\n", or its "</think>\n\n" (enable_thinking=False)
NEWLINE, TWO_NEWLINES = 198, 271
REASONING = "The user wants the weather"
CALL_JSON = '{"name":"get_weather","arguments":{"city": "Paris"}}'
ANSWER = "It is sunny in Paris."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=48)


def make_scripted_checkpoint(path: Path, tokenizer_dir: Path, scripts: list[list[int]]) -> Path:
    """A Qwen3 checkpoint whose greedy output follows `scripts`: in each list of token ids, every token is followed
    by the next (a bigram model: its attention and MLP weights are zero, so the last token alone picks the next;
    embedding and LM head put each scripted token on a hidden dimension of its own). A token may begin only one
    step, so no token may repeat within or across scripts (but for the last of each)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    steps = [(a, b) for script in scripts for a, b in zip(script, script[1:])]
    assert len({a for a, _ in steps}) == len(steps), "a token begins two steps"
    config = Qwen3Config(vocab_size=151669, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    assert len(steps) <= config.hidden_size
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            weight.fill_(1.0 if "norm" in name else 0.0)
        for dim, (a, b) in enumerate(steps):
            model.model.embed_tokens.weight[a, dim] = 1.0
            model.lm_head.weight[b, dim] = 10.0  # logit 80 after the final RMSNorm (8 times the unit vector)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Iterator[LLM]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    thinks_then_calls = [NEWLINE, THINK_START, *ids(REASONING), THINK_END, CALL_START, *ids(CALL_JSON), CALL_END,
                         IM_END]
    answers = [TWO_NEWLINES, *ids(ANSWER), IM_END]
    path = make_scripted_checkpoint(tmp_path_factory.mktemp("scripted-qwen3"), qwen3_tokenizer_dir,
                                    [thinks_then_calls, answers])
    engine = LLM(str(path), device="cpu", max_model_len=1024, num_kvcache_blocks=128, tool_call_parser="hermes",
                 reasoning_parser="qwen3")
    yield engine
    engine.shutdown()


def test_a_thinking_answer_is_split_into_reasoning_and_the_call_the_model_wrote(llm: LLM) -> None:
    (out,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=[WEATHER])  # tool_choice "auto": the default with a parser

    assert out["text"] == f"<think>{REASONING}</think><tool_call>{CALL_JSON}</tool_call>"
    assert out["reasoning_content"] == REASONING and out["content"] is None
    (call,) = out["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out["outputs"][0]["tool_calls"] == out["tool_calls"] and out["finish_reason"] == "stop"


def test_an_agent_loop_answers_in_words_after_the_tools_result(llm: LLM) -> None:
    (first,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=[WEATHER])
    call = first["tool_calls"][0]
    history = [*ASK, {"role": "assistant", "content": first["content"], "tool_calls": [call],
                      "reasoning_content": first["reasoning_content"]},
               {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 C."}]

    (final,) = llm.chat(history, GREEDY, use_tqdm=False, tools=[WEATHER],
                        chat_template_kwargs={"enable_thinking": False})

    assert final["content"] == ANSWER and final["tool_calls"] == [] and final["reasoning_content"] is None


def test_with_the_reasoning_closed_in_the_prompt_the_whole_output_is_content(llm: LLM) -> None:
    (out,) = llm.chat(ASK, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})

    assert (out["text"], out["content"], out["reasoning_content"]) == (ANSWER, ANSWER, None)


def test_a_required_call_is_forced_only_after_the_reasoning(llm: LLM) -> None:
    """The model thinks first (the grammar lets its first token open the reasoning and stays out of it); after
    </think> the grammar forces the JSON array of calls, though the model would write its <tool_call> tag."""
    (out,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)

    assert out["reasoning_content"] == REASONING and out["finish_reason"] == "stop", out["text"]
    (call,) = out["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in (
        "Paris", "Oslo")
    assert out["text"].startswith(f"<think>{REASONING}</think>[")


def test_a_tool_choice_that_cannot_run_is_refused_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(ValueError, match="'get_news' is not among the tools"):
        llm.chat(ASK, GREEDY, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_news"}})
    with pytest.raises(ValueError, match="structured_outputs: not with tool_choice 'required'"):
        llm.chat(ASK, SamplingParams(structured_outputs={"json_object": True}), tools=[WEATHER],
                 tool_choice="required")
