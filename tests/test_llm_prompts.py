"""What `LLM.generate` takes as its prompts: any iterable of prompts, and a clear error naming the
prompt of the wrong type."""

from __future__ import annotations

import re

import pytest

from common.protocol import GenerateRequest
from deltaserve import LLM, SamplingParams
from tests.test_engine_e2e import llm  # noqa: F401  (the engine fixture, started once for this module)

GREEDY4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_a_generator_of_prompts_is_taken_like_a_list(llm: LLM) -> None:  # noqa: F811
    prompts = ["hello", [5, 6, 7]]
    expected = [o["token_ids"] for o in llm.generate(prompts, GREEDY4, use_tqdm=False)]
    got = [o["token_ids"] for o in llm.generate((p for p in prompts), GREEDY4, use_tqdm=False)]
    assert got == expected and all(len(t) == 4 for t in got)


@pytest.mark.parametrize("prompts", [[[1.0, 2.0], "Hello"], ["Hello", None]])
def test_a_prompt_of_the_wrong_type_is_named_by_its_index(llm: LLM, prompts: list) -> None:  # noqa: F811
    bad = next(i for i, p in enumerate(prompts) if p != "Hello")
    with pytest.raises(TypeError, match=f"^prompt {bad}: "):
        llm.generate(prompts, GREEDY4, use_tqdm=False)


def test_the_zmq_client_names_wrong_sampling_params_and_its_own_closing(llm: LLM) -> None:  # noqa: F811
    from frontend.client import EngineClient, EngineConnectionError

    client = EngineClient(llm.engine.endpoints.client)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got dict"):
        next(client.generate("hi", {"temperature": 0}))
    assert [o.finished for o in client.generate("hi", GREEDY4, stream=False)] == [True]
    client.close()
    with pytest.raises(EngineConnectionError, match="has been closed"):
        next(client.generate("hi", GREEDY4))


@pytest.mark.parametrize("prompts", [None, 5, 2.5, {"a", "b"}])
def test_prompts_that_are_not_a_prompt_or_a_list_are_named(llm: LLM, prompts: object) -> None:  # noqa: F811
    with pytest.raises(TypeError, match=f"^prompts must be a text, token ids, a dict prompt, or a list of them, got "
                                        f"{type(prompts).__name__}$"):
        llm.generate(prompts, GREEDY4, use_tqdm=False)


def test_a_client_in_use_by_one_thread_refuses_another_at_once_and_serves_the_first(llm: LLM) -> None:  # noqa: F811
    """ZeroMQ sockets are not thread-safe: a second thread calling a client while another thread's
    generate() runs gets a clear error (it used to hang forever, its outputs taken by the other thread);
    the first thread's request finishes, and taking turns across threads works."""
    import threading

    from frontend.client import EngineClient

    client = EngineClient(llm.engine.endpoints.client)
    try:
        long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        first = client.generate("Tell me a story", long, stream=True)
        outputs = [next(first)]  # under way in this thread
        errors: list[BaseException] = []

        def other() -> None:
            try:
                list(client.generate("hi", GREEDY4))
            except RuntimeError as exc:
                errors.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive()
        assert len(errors) == 1 and "in use by another thread" in str(errors[0])
        outputs += list(first)
        assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) == 64

        turn: list[list] = []
        t = threading.Thread(target=lambda: turn.append(list(client.generate("hi", GREEDY4, stream=False))))
        t.start()
        t.join(timeout=60)
        assert turn and turn[0][-1].finished and len(turn[0][-1].token_ids) == 4
    finally:
        client.close()


# ----------------------------------------------------------------------------- what vLLM users reach for
USER_HI = [{"role": "user", "content": "hi"}]


def chat_template_ids(llm: LLM, messages: list[dict], **kwargs: object) -> list[int]:  # noqa: F811
    kwargs.setdefault("add_generation_prompt", True)
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, **kwargs)
    return llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_vllm_dict_prompts_run_as_the_text_or_the_token_ids_they_hold(llm: LLM) -> None:  # noqa: F811
    plain = llm.generate(["hello", [5, 6, 7]], GREEDY4, use_tqdm=False)
    as_dicts = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": [5, 6, 7]}], GREEDY4, use_tqdm=False)
    one = llm.generate({"prompt": "hello"}, GREEDY4, use_tqdm=False)
    assert [o["token_ids"] for o in as_dicts] == [o["token_ids"] for o in plain] and len(plain[0]["token_ids"]) == 4
    assert [o["token_ids"] for o in one] == [plain[0]["token_ids"]]


@pytest.mark.parametrize(("prompt", "message"), [
    ({"role": "user", "content": "hi"}, "a chat message goes in a list of them"),
    ({"prompt": "hi", "multi_modal_data": {}}, "got one with keys ['multi_modal_data', 'prompt']"),
])
def test_a_dict_prompt_with_other_keys_is_refused_naming_what_one_holds(
        llm: LLM, prompt: dict, message: str) -> None:  # noqa: F811
    with pytest.raises(TypeError, match=r"^prompt 1: a dict prompt is ") as info:
        llm.generate(["fine", prompt], GREEDY4, use_tqdm=False)
    assert message in str(info.value)


@pytest.mark.parametrize(("prompts", "message"), [
    ([{"prompt": 5}], "prompt 0: a dict prompt's 'prompt' must be a str, got int"),
    ([{"prompt": [1, 2]}], "prompt 0: a dict prompt's 'prompt' must be a str, got list"),
    ([{"prompt_token_ids": "abc"}], "prompt 0: a dict prompt's 'prompt_token_ids' must be a sequence of integer "
                                    "token ids, got str"),
    ([{"prompt_token_ids": [1, "a"]}], "prompt 0: a dict prompt's 'prompt_token_ids' must be a sequence of integer "
                                       "token ids, got a list with 'a' (str) at index 1"),
    ([5, "a"], "prompt 0: a prompt must be a str or a sequence of integer token ids, got a list with 'a' (str) at "
               "index 1"),
    (["a", 5], "prompt 1: a prompt must be a str or a sequence of integer token ids, got int"),
])
def test_a_prompt_holding_a_value_of_the_wrong_type_is_refused_naming_the_type(
        llm: LLM, prompts: list, message: str) -> None:  # noqa: F811
    """`{"prompt": 5}` was refused for its keys, which were right (a fresh user's trial)."""
    with pytest.raises(TypeError) as info:
        llm.generate(prompts, GREEDY4, use_tqdm=False)
    assert str(info.value) == message


def test_a_result_carries_its_prompt_length_prefix_cache_hit_and_timings(llm: LLM) -> None:  # noqa: F811
    """The keys docs/python-api.md describes: 40 prompt tokens are two full 16-token blocks and a partial one, so a
    second run finds 32 of them in the prefix cache; timings are in seconds, and a refused request has none."""
    prompt = list(range(100, 140))
    first, again = (llm.generate([prompt], GREEDY4, use_tqdm=False)[0] for _ in range(2))
    refused = llm.generate([""], GREEDY4, use_tqdm=False)[0]
    assert (first["num_prompt_tokens"], first["num_cached_tokens"]) == (40, 0)
    assert (again["num_prompt_tokens"], again["num_cached_tokens"]) == (40, 32)
    metrics = again["metrics"]
    assert set(metrics) == {"ttft_s", "e2e_s", "queue_s", "num_preemptions"} and metrics["num_preemptions"] == 0
    assert 0 < metrics["ttft_s"] <= metrics["e2e_s"] < 60 and 0 <= metrics["queue_s"] < 60
    assert (refused["finish_reason"], refused["num_prompt_tokens"], refused["metrics"]) == ("error", 0, {})


def test_get_tokenizer_encodes_a_prompt_as_the_engine_does(llm: LLM) -> None:  # noqa: F811
    out = llm.generate(["Hello, my name is"], GREEDY4, use_tqdm=False)[0]
    assert llm.get_tokenizer() is llm.tokenizer
    assert out["num_prompt_tokens"] == len(llm.get_tokenizer()("Hello, my name is")["input_ids"])


def test_chat_renders_the_conversation_with_the_chat_template(llm: LLM) -> None:  # noqa: F811
    ids = chat_template_ids(llm, USER_HI)
    (reply,) = llm.chat(USER_HI, GREEDY4, use_tqdm=False)
    (same,) = llm.generate([{"prompt_token_ids": ids}], GREEDY4, use_tqdm=False)
    assert reply["error"] is None and reply["num_prompt_tokens"] == len(ids)
    assert reply["token_ids"] == same["token_ids"] and len(reply["token_ids"]) == 4


def test_chat_takes_a_list_of_conversations_and_answers_each_in_order(llm: LLM) -> None:  # noqa: F811
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    replies = llm.chat([USER_HI, other, USER_HI], GREEDY4, use_tqdm=False)
    expected = [len(chat_template_ids(llm, c)) for c in (USER_HI, other, USER_HI)]
    assert [r["num_prompt_tokens"] for r in replies] == expected
    alone = llm.chat(USER_HI, GREEDY4, use_tqdm=False)[0]
    assert replies[0]["token_ids"] == replies[2]["token_ids"] == alone["token_ids"]


@pytest.mark.parametrize("options", [
    dict(add_generation_prompt=False),
    dict(add_generation_prompt=False, continue_final_message=True),
    dict(chat_template_kwargs={"enable_thinking": False}),
])
def test_chat_passes_the_template_options_as_vllm_does(llm: LLM, options: dict) -> None:  # noqa: F811
    messages = [*USER_HI, {"role": "assistant", "content": "Hel"}] if options.get("continue_final_message") else USER_HI
    template_kwargs = {k: v for k, v in options.items() if k != "chat_template_kwargs"}
    expected = chat_template_ids(llm, messages, **template_kwargs, **options.get("chat_template_kwargs", {}))
    assert expected != chat_template_ids(llm, messages)  # the option changes the rendered prompt
    (reply,) = llm.chat(messages, GREEDY4, use_tqdm=False, **options)
    assert reply["error"] is None and reply["num_prompt_tokens"] == len(expected)


def test_chat_refuses_contradicting_options_and_conversations_that_are_not_lists_of_dicts(
        llm: LLM) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message cannot both be true"):
        llm.chat(USER_HI, GREEDY4, continue_final_message=True)
    with pytest.raises(TypeError, match="^conversation 1 must be a non-empty list of"):
        llm.chat([USER_HI, "hi"], GREEDY4)
    with pytest.raises(TypeError, match="^conversation 0 must be a non-empty list of"):
        llm.chat([[]], GREEDY4)


@pytest.mark.parametrize(("messages", "got"), [("hello", "str; a text prompt goes to generate"),
                                             ({"role": "user", "content": "hi"}, "dict"), (None, "NoneType")])
def test_chat_refuses_messages_that_are_not_a_list_naming_what_it_got(
        llm: LLM, messages: object, got: str) -> None:  # noqa: F811
    """`chat("hello")` iterated the string and named its first character, 'h' (a fresh user's trial)."""
    with pytest.raises(TypeError) as info:
        llm.chat(messages, GREEDY4, use_tqdm=False)
    assert str(info.value) == ("messages must be a list of {'role': ..., 'content': ...} dicts (one conversation) or "
                               f"a list of such lists, got {got}")


def test_an_empty_list_of_prompts_or_of_conversations_returns_an_empty_list(llm: LLM) -> None:  # noqa: F811
    assert llm.generate([], GREEDY4, use_tqdm=False) == []
    assert llm.chat([], GREEDY4, use_tqdm=False) == []


def test_a_chat_template_argument_passed_as_a_template_variable_fails_that_conversation_alone(
        llm: LLM) -> None:  # noqa: F811
    from tests.test_engine_e2e import submit_and_wait

    outs = submit_and_wait(llm, [GenerateRequest("a", messages=USER_HI, chat_template_kwargs={"tokenize": True}),
                                 GenerateRequest("b", messages=USER_HI, sampling={"max_tokens": 2,
                                                                                  "temperature": 0.0})])
    assert outs["a"].finish_reason == "error" and "chat_template_kwargs cannot set ['tokenize']" in outs["a"].error
    assert outs["b"].error is None and len(outs["b"].token_ids) == 2


def test_use_tqdm_is_keyword_only(llm: LLM) -> None:  # noqa: F811
    """A third positional argument was taken as `use_tqdm` (a fresh user's trial)."""
    with pytest.raises(TypeError, match="positional argument"):
        llm.generate(["hi"], GREEDY4, False)
    with pytest.raises(TypeError, match="positional argument"):
        llm.chat(USER_HI, GREEDY4, False)


def test_the_progress_bar_shows_input_and_output_tokens_per_second(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from tqdm import tqdm

    import frontend.llm

    postfixes: list[str] = []

    class RecordingBar(tqdm):
        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            postfixes.append(s)
            super().set_postfix_str(s, refresh)

    monkeypatch.setattr(frontend.llm, "tqdm", RecordingBar)
    outs = llm.generate(["hello", "a longer prompt than the first one"], GREEDY4, use_tqdm=True)

    assert len(postfixes) == 2
    match = re.fullmatch(r"input (\d+\.\d) tok/s, output (\d+\.\d) tok/s", postfixes[-1])
    assert match, postfixes
    num_input, num_output = sum(o["num_prompt_tokens"] for o in outs), sum(len(o["token_ids"]) for o in outs)
    input_rate, output_rate = float(match.group(1)), float(match.group(2))
    assert input_rate > 0 and output_rate > 0
    assert input_rate / output_rate == pytest.approx(num_input / num_output, rel=0.02)  # over the same elapsed time


@pytest.mark.parametrize(("params", "message"), [
    ("greedy", "^sampling_params must be SamplingParams or a list of them, got str$"),
    ([None], r"^sampling_params\[0\] must be SamplingParams, got NoneType$"),
    ({"temperature": 0}, "^sampling_params must be SamplingParams, got dict$"),
])
def test_sampling_params_of_the_wrong_type_are_named(llm: LLM, params: object, message: str) -> None:  # noqa: F811
    with pytest.raises(TypeError, match=message):
        llm.generate(["Hi"], params, use_tqdm=False)
    with pytest.raises(TypeError, match=message):
        llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)


@pytest.mark.parametrize(("messages", "error"), [
    ([{"role": "user", "content": 5}], "messages[0].content must be a string, got int '5'"),
    ([{"role": "system", "content": "be brief"}, {"role": "user"}],
     "messages[1].content must be a string, got nothing"),
    ([{"content": "hi"}], "messages[0].role must be a string, got nothing"),
])
def test_a_chat_message_without_text_content_or_role_is_named_in_its_error(
        llm: LLM, messages: list, error: str) -> None:  # noqa: F811
    (reply,) = llm.chat(messages, GREEDY4, use_tqdm=False)
    assert reply["error"] is not None and error in reply["error"], reply["error"]
