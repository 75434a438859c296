"""The OpenAI-compatible HTTP server, driven by the official `openai` client and raw httpx, against a server
started as a user starts it (`launch.py --http-port`) on a tiny random checkpoint with the real Qwen3 tokenizer."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from common.sampling_params import SamplingParams
from tests.openai_server import API_KEY, HTTPServer, http_server

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NUM_KV_BLOCKS = 512


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http")


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, server_dir: Path) -> Iterator[HTTPServer]:
    with http_server(tiny_qwen3, server_dir, "--max-model-len", "512", "--num-kvcache-blocks", str(NUM_KV_BLOCKS),
                     "--served-model-name", "tiny", "tiny-alias", "--profile-dir", str(server_dir / "profile"),
                     "--profile-steps", "none") as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> object:
    return AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.fixture(scope="module")
def client(server: HTTPServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server: HTTPServer, path: str, body: object, headers: dict[str, str] | None = None,
         **kwargs: object) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    hdrs = {"Content-Type": "application/json", **server.headers, **(headers or {})}
    return httpx.post(f"{server.url}{path}", content=data, headers=hdrs, timeout=120, **kwargs)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE stream, in order (blank separator lines checked and dropped)."""
    lines = list(response.iter_lines())
    events = [line[len("data: "):] for line in lines if line]
    assert all(line.startswith("data: ") for line in lines if line), lines
    return events


def idle(m: dict[str, float]) -> bool:
    return (m["deltaserve:num_requests_running"] == 0 and m["deltaserve:num_requests_waiting"] == 0
            and m["deltaserve:kv_cache_usage_perc"] == 0)


# ---------------------------------------------------------------------------------------------- plain routes
def test_models_lists_every_served_name_and_retrieves_one(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert all(m.max_model_len == 512 for m in models.data)
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_tokenize_refuses_a_prompt_the_wire_cannot_carry_as_a_400(server: HTTPServer) -> None:
    response = post(server, "/tokenize", {"prompt": "caf\ud800"})  # a lone surrogate: it was a 500
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "lone surrogate" in error["message"], error
    assert post(server, "/tokenize", {"prompt": "hi"}).status_code == 200


@pytest.mark.parametrize("options", [
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"add_generation_prompt": False, "continue_final_message": True},
])
def test_chat_template_options_reach_the_template(client: openai.OpenAI, tiny_qwen3: Path, options: dict) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Hel"}] if options.get("continue_final_message") else CHAT
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    template = {k: v for k, v in options.items() if k != "chat_template_kwargs"}
    text = tok.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **template},
                                   **options.get("chat_template_kwargs", {}))
    chat = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=1,
                                          extra_body=options)
    assert chat.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_a_response_carries_the_first_served_name_whichever_was_asked(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="tiny-alias", prompt="hi", max_tokens=1)
    chat = client.chat.completions.create(model="tiny-alias", messages=CHAT, max_completion_tokens=1)
    assert completion.model == chat.model == "tiny"  # vLLM's rule for several --served-model-name


def test_health_and_version_need_no_key(server: HTTPServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/version").json()["version"]
    assert version and version != "unknown"


# ---------------------------------------------------------------------------------------------- generation
def test_greedy_completion_and_chat_equal_llm_generate_on_the_same_prompt(client: openai.OpenAI, tiny_qwen3: Path,
                                                                          engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, max_model_len=512)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    chat_ids = tok(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want_text, want_chat = llm.generate([PROMPT, chat_ids], params, use_tqdm=False)

    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})

    assert completion.choices[0].text == want_text["text"]
    assert completion.choices[0].finish_reason == "length"
    assert completion.model == "tiny" and completion.id.startswith("cmpl-")
    assert completion.usage.prompt_tokens == want_text["num_prompt_tokens"]
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12
    assert chat.choices[0].message.content == want_chat["text"]
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(chat_ids) and chat.usage.completion_tokens == 12
    assert chat.usage.ttft_s > 0 and chat.usage.tpot_s > 0  # our debugging extras

    # n = 2, a stop string made of the end of one output token and the start of the next, and logprobs: as
    # LLM.generate gives them with the same parameters.
    texts = [e["decoded_token"] for e in llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                                             ignore_eos=True, logprobs=0),
                                                      use_tqdm=False)[0]["outputs"][0]["logprobs"]]
    stop, cut = boundary_stop(texts, want_text["text"])
    rich = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2, stop=[stop], logprobs=2)
    want_rich, want_rich_chat = llm.generate([PROMPT, chat_ids], rich, use_tqdm=False)
    assert want_rich["text"] == want_text["text"][:cut]

    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                           stop=stop, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1]
    for choice, want in zip(completion.choices, want_rich["outputs"]):
        assert (choice.text, choice.finish_reason, choice.stop_reason) == (want["text"], "stop", stop)
        assert choice.logprobs.tokens == [e["decoded_token"] for e in want["logprobs"]]
        assert choice.logprobs.token_logprobs == pytest.approx([e["logprob"] for e in want["logprobs"]], abs=1e-4)
        assert [list(top) for top in choice.logprobs.top_logprobs] == [
            list(dict.fromkeys([e["decoded_token"]] + [t["decoded_token"] for t in e["top"]]))
            for e in want["logprobs"]]
    assert completion.usage.completion_tokens == sum(len(o["token_ids"]) for o in want_rich["outputs"])

    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, n=2, stop=[stop],
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    for choice, want in zip(chat.choices, want_rich_chat["outputs"]):
        assert (choice.message.content, choice.finish_reason) == (want["text"], want["finish_reason"])
        assert [(e.token, [t.token for t in e.top_logprobs]) for e in choice.logprobs.content] == [
            (e["decoded_token"], [t["decoded_token"] for t in e["top"]]) for e in want["logprobs"]]
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx([e["logprob"] for e in want["logprobs"]],
                                                                            abs=1e-4)


def boundary_stop(token_texts: list[str], text: str) -> tuple[str, int]:
    """A two-character stop string made of the last character of one output token and the first of the next,
    whose first occurrence in `text` is there; and where the text ends when cut before it."""
    for k in range(len(token_texts) - 1):
        a, b = token_texts[k], token_texts[k + 1]
        end = len("".join(token_texts[: k + 1]))
        stop = a[-1:] + b[:1]
        if (len(stop) == 2 and stop.isprintable() and "\ufffd" not in stop
                and text.startswith("".join(token_texts[: k + 2])) and text.find(stop) == end - 1):
            return stop, end - 1
    raise AssertionError(f"no stop string spans two tokens of {token_texts}")


def test_token_id_prompts_and_lists_of_prompts_are_choices_in_order(client: openai.OpenAI,
                                                                   server: HTTPServer) -> None:
    prompts = ["Hello", "The sky is", "One two three"]
    singles = [client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage.completion_tokens == 15
    ids = post(server, "/tokenize", {"prompt": "Hello"}).json()["tokens"]
    by_ids = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == [singles[0], singles[0]]


def test_streamed_completion_joins_to_the_non_streamed_text_and_ends_with_a_usage_chunk(
        client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_is_sse_as_openai_sends_it(server: HTTPServer) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers,
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert all(c["usage"] is None for c in chunks[:-1])  # include_usage: null until the usage chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    plain = post(server, "/v1/chat/completions", {**body, "stream": False, "stream_options": None}).json()
    assert "".join(content) == plain["choices"][0]["message"]["content"]


def test_a_seed_makes_sampled_text_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=5.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1


def test_fields_at_their_neutral_values_are_accepted(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, n=1, top_p=1.0, temperature=0,
                                         presence_penalty=0.0, frequency_penalty=0.0, logprobs=False, stop=None,
                                         user="someone", extra_body={"top_k": -1, "min_p": 0.0,
                                                                     "repetition_penalty": 1.0, "min_tokens": 0})
    assert out.choices[0].finish_reason in ("stop", "length")


def test_n_samples_of_each_prompt_are_choices_prompt_times_n_plus_sample_and_a_seed_repeats_them(
        client: openai.OpenAI) -> None:
    def sample(seed: int, n: int = 3, prompt: object = PROMPT) -> openai.types.Completion:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=5.0, seed=seed, n=n,
                                         extra_body={"ignore_eos": True})

    first = sample(11)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert [c.text for c in sample(11).choices] == texts  # same seed, same samples
    assert len(set(texts)) > 1  # the samples are independent draws
    assert sample(11, n=1).choices[0].text == texts[0]  # sample 0 draws with the seed itself
    assert first.usage.completion_tokens == 18 and first.usage.prompt_tokens == sample(1, 1).usage.prompt_tokens

    both = sample(11, n=2, prompt=[PROMPT, "Hello"])
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices[:2]] == texts[:2]
    assert [c.text for c in both.choices[2:]] == [c.text for c in sample(11, n=2, prompt="Hello").choices]
    assert both.usage.completion_tokens == 24


def test_a_stream_of_n_samples_interleaves_its_choices_each_with_its_own_end_and_counts_them_in_usage(
        server: HTTPServer) -> None:
    body = {"model": "tiny", "prompt": [PROMPT, "Hello"], "n": 2, "max_tokens": 5, "temperature": 5.0, "seed": 4,
            "ignore_eos": True, "logprobs": 1}
    whole = post(server, "/v1/completions", body).json()
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.headers, timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1]) and chunks[-1]["choices"] == []
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == choice["logprobs"]["tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 20 == whole["usage"]["completion_tokens"]
    assert chunks[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_a_chat_stream_of_n_samples_opens_every_choice_with_its_role_and_ends_each(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 5, "temperature": 5.0, "seed": 8, "n": 3,
              "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:3]] == [(i, "assistant") for i in range(3)]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine][-1] == "length" and sum(c.finish_reason is not None for c in mine) == 1
    assert whole.usage.completion_tokens == 15


def test_a_stop_string_split_over_tokens_ends_text_and_stream_before_it_with_vllms_stop_reason(
        client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    stop, cut = boundary_stop(full.logprobs.tokens, full.text)
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop, "never"],
              "extra_body": {"ignore_eos": True}}
    cut_off = client.completions.create(**kwargs).choices[0]
    assert (cut_off.text, cut_off.finish_reason, cut_off.stop_reason) == (full.text[:cut], "stop", stop)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.text[:cut]  # nothing of the stop string streamed
    assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("stop", stop)
    kept = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True,
                                                                 "include_stop_str_in_output": True}}).choices[0]
    assert kept.text == full.text[:cut] + stop


def test_stop_reason_is_the_stop_token_id_but_none_at_the_end_of_sequence_token(client: openai.OpenAI,
                                                                                 tokenizer: object) -> None:
    eos, other = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert eos != other
    at_eos = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                       logit_bias={str(eos): 100}).choices[0]
    assert (at_eos.text, at_eos.finish_reason, at_eos.stop_reason) == ("", "stop", None)
    by_id = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                      logit_bias={str(other): 100}, extra_body={"stop_token_ids": [other]})
    assert (by_id.choices[0].finish_reason, by_id.choices[0].stop_reason, by_id.usage.completion_tokens) == (
        "stop", other, 1)
    late = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert (late.choices[0].finish_reason, late.usage.completion_tokens) == ("stop", 4)  # masked for 3 tokens
    ignored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                        logit_bias={str(eos): 100}, extra_body={"ignore_eos": True,
                                                                               "skip_special_tokens": False})
    assert (ignored.choices[0].text, ignored.choices[0].finish_reason) == ("<|im_end|>" * 3, "length")


def test_filters_penalties_and_bad_words_change_what_is_sampled(client: openai.OpenAI, tokenizer: object) -> None:
    def tokens(**kwargs: object) -> list[str]:
        extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=0, extra_body=extra,
                                         **kwargs).choices[0].logprobs.tokens

    greedy = tokens(temperature=0)
    assert tokens(temperature=5.0, seed=1, extra_body={"top_k": 1}) == greedy  # one candidate left: the argmax
    assert tokens(temperature=5.0, seed=1, top_p=1e-6) == greedy
    assert tokens(temperature=5.0, seed=1, extra_body={"min_p": 1.0}) == greedy
    assert tokens(temperature=5.0, seed=1) != greedy
    assert tokens(temperature=0, extra_body={"bad_words": [greedy[0].strip()]})[0] != greedy[0]
    # A huge repetition penalty leaves no token of the prompt or of the output so far a chance.
    unrepeated = tokens(temperature=0, extra_body={"repetition_penalty": 1e30})
    assert len(set(unrepeated)) == len(unrepeated)
    assert not set(unrepeated) & {tokenizer.decode([i]) for i in tokenizer(PROMPT)["input_ids"]}
    penalized = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=-2.0, extra_body={"ignore_eos": True})
    assert penalized.usage.completion_tokens == 8


def test_completion_logprobs_are_openais_tokens_logprobs_top_dicts_and_offsets(client: openai.OpenAI) -> None:
    choice = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True}).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is the most likely
        assert 3 <= len(top) <= 4 and logprob <= 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_logprobs_are_openais_content_entries_also_when_streamed(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
              "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 6
    for e in content:
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob) and len(e.top_logprobs) == 3
        assert e.bytes == list(e.token.encode()) and all(t.bytes == list(t.token.encode()) for t in e.top_logprobs)
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**kwargs, "top_logprobs": None}).choices[0].logprobs.content
    assert [e.token for e in plain] == [e.token for e in content] and all(e.top_logprobs == [] for e in plain)


def test_prompt_logprobs_are_vllms_per_prompt_token_and_refused_when_streaming(server: HTTPServer,
                                                                               tokenizer: object) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "n": 2}
    choices = post(server, "/v1/completions", body).json()["choices"]
    for choice in choices:
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for token_id, position in zip(ids[1:], got[1:]):
            assert position[str(token_id)]["rank"] >= 1 and 2 <= len(position) <= 3
            assert sorted(p["rank"] for p in position.values() if p["rank"] <= 2)[:2] == [1, 2]
    chat = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2,
                                                  "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    refused = post(server, "/v1/completions", {**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_start_and_stop_profile_trace_the_engine_and_need_the_key(server: HTTPServer, client: openai.OpenAI,
                                                                  server_dir: Path) -> None:
    url = server.url
    assert httpx.post(f"{url}/start_profile", timeout=60).status_code == 401
    started = httpx.post(f"{url}/start_profile", headers=server.headers, timeout=60)
    assert started.status_code == 200, started.text
    session = started.json()
    assert session["folder"].startswith(str(server_dir / "profile")) and session["last_step"] >= session["first_step"]
    again = httpx.post(f"{url}/start_profile", headers=server.headers, timeout=60)
    assert again.status_code == 400 and again.json()["error"]["code"] == "profiling_refused"
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    stopped = httpx.post(f"{url}/stop_profile", headers=server.headers, timeout=300)
    assert stopped.status_code == 200, stopped.text
    summary = stopped.json()
    assert summary["session"] == session["session"] and "deltaserve profile" in summary["summary"]
    assert (Path(summary["folder"]) / "timeline.json.gz").is_file()
    idle_stop = httpx.post(f"{url}/stop_profile", headers=server.headers, timeout=60)
    assert idle_stop.status_code == 400 and "not profiling" in idle_stop.json()["error"]["message"]
    bad = post(server, "/start_profile", {"num_steps": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_steps"
    bounded = post(server, "/start_profile", {"num_steps": 2})
    assert bounded.status_code == 200 and bounded.json()["last_step"] == bounded.json()["first_step"] + 1
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)  # the session ends after its 2 steps
    assert "Traceback" not in server.stderr()


@pytest.mark.parametrize(("kwargs", "param"), [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
                                               ({"best_of": 2}, "best_of")])
def test_completion_echo_suffix_and_best_of_are_refused_clearly(client: openai.OpenAI, kwargs: dict,
                                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, **kwargs)
    assert err.value.body["param"] == param


def test_prompt_longer_than_the_context_is_a_400_naming_both_lengths(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[7] * 600, max_tokens=3)
    assert "600 tokens" in err.value.body["message"] and "max_model_len is 512" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # also when streaming: refused before the stream starts
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 600}],
                                       stream=True)
    assert "max_model_len is 512" in err.value.body["message"] and err.value.body["param"] == "messages"


def test_a_refused_request_counts_as_a_failure_not_a_success(server: HTTPServer, client: openai.OpenAI) -> None:
    before = server.wait_metrics(idle)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[7] * 600, max_tokens=3)
    failures = "deltaserve:request_failure_total"
    after = server.wait_metrics(lambda m: m[failures] > before[failures])
    assert after[failures] == before[failures] + 1
    successes = [k for k in after if k.startswith("deltaserve:request_success_total")]
    assert sorted(successes) == [f"deltaserve:request_success_total{{finished_reason={r}}}"
                                 for r in ("abort", "length", "stop")]
    assert all(after[k] == before[k] for k in successes)


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_of_several_runs_none_of_them(server: HTTPServer, client: openai.OpenAI,
                                                        stream: bool) -> None:
    """One 400 for the call, so its valid prompts must not run: they would spend the engine's time on an answer
    the client never gets, and count as successes in /metrics."""
    before = server.wait_metrics(idle)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=["Hi", "", "Hello there"], max_tokens=3, stream=stream,
                                  extra_body={"ignore_eos": True})
    assert err.value.body["message"].startswith("prompt[1]: ") and err.value.body["param"] == "prompt"
    failures = "deltaserve:request_failure_total"
    after = server.wait_metrics(lambda m: idle(m) and m[failures] >= before[failures] + 3)
    assert after[failures] == before[failures] + 3  # the refused prompt and the two it sank
    assert after["deltaserve:generation_tokens_total"] == before["deltaserve:generation_tokens_total"]
    assert all(after[k] == before[k] for k in after if k.startswith("deltaserve:request_success_total"))
    out = client.completions.create(model="tiny", prompt=["Hi", "Hello there"], max_tokens=2)  # still serving
    assert len(out.choices) == 2


def test_a_prompt_and_max_tokens_beyond_the_context_is_a_400_as_in_vllm(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:  # 500 + 16 (the completions default) > 512
        client.completions.create(model="tiny", prompt=[7] * 500)
    assert err.value.body["param"] == "prompt"
    assert err.value.body["message"] == ("prompt: This model's maximum context length is 512 tokens. However, you "
                                         "requested "
                                         "516 tokens (500 in the prompt, 16 in the completion). Please reduce the "
                                         "length of the prompt or completion.")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=600, stream=True)
    assert err.value.body["param"] == "messages" and "600 in the completion" in err.value.body["message"]
    fits = client.completions.create(model="tiny", prompt=[7] * 500, max_tokens=12, temperature=0)
    assert fits.usage.prompt_tokens + fits.usage.completion_tokens <= 512
    # Without max_tokens a chat request may use the rest of the context, OpenAI's default: no refusal.
    rest = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}],
                                          temperature=0, stop=None, extra_body={"ignore_eos": True})
    assert rest.choices[0].finish_reason == "length"
    assert rest.usage.prompt_tokens + rest.usage.completion_tokens == 512


def test_tokenize_and_detokenize_round_trip_like_the_prompt_runs(server: HTTPServer, tiny_qwen3: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    got = post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert got == {"count": len(tok(PROMPT)["input_ids"]), "max_model_len": 512, "tokens": tok(PROMPT)["input_ids"]}
    chat = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert chat == tok(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    no_turn = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert len(no_turn) < len(chat) and chat[:len(no_turn)] == no_turn
    assert post(server, "/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": PROMPT}
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---------------------------------------------------------------------------------------------- bad input
BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens", "less than 9223372036854775808"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "valid integer"),
    # the wrong JSON type is refused, not converted (they ran as 3 tokens, 1 token and a stream)
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "valid integer"),
    ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens", "valid boolean"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature", "valid number"),
    ({"prompt": "x", "seed": -1}, "seed", "greater than or equal to 0"),
    ({"prompt": "x", "seed": 2**64}, "seed", "less than 9223372036854775808"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "stream": "yes please"}, "stream", "valid boolean"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "unknown_field": 1}, "unknown_field", "unknown field"),
    ({"prompt": 5}, "prompt", "none of the accepted types"),
    ({"prompt": [1, "two"]}, "prompt", "none of the accepted types"),
    ({"prompt": [[1], [-2]]}, "prompt", "prompt[1][0]: Input should be greater than or equal to 0, got -2"),
    ({"prompt": [-3]}, "prompt", "prompt[0]: Input should be greater than or equal to 0, got -3"),
    ({"prompt": [5, 2**70]}, "prompt", "prompt[1]: Input should be less than 9223372036854775808"),
    ({"prompt": {"text": "x"}}, "prompt", "prompt: an object is none of the accepted types"),
    ({"prompt": []}, "prompt", "must not be an empty list"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": ["a", ""]}, "prompt", "prompt[1]: "),  # which of the prompts
    ({"prompt": [151669]}, "prompt", "[0, 151669)"),
    ({"prompt": [2**63 - 1]}, "prompt", "[0, 151669)"),
    ({}, "prompt", "Field required"),
    # the sampling fields of issue 11: wrong types, ranges and huge values
    ({"prompt": "x", "n": 129}, "n", "less than or equal to 128"),
    ({"prompt": "x", "n": "two"}, "n", "valid integer"),
    ({"prompt": "x", "n": 2.5}, "n", "valid integer"),
    ({"prompt": "x", "seed": 1.5}, "seed", "valid integer"),
    ({"prompt": "x", "top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"prompt": "x", "top_k": 10**30}, "top_k", "less than 9223372036854775808"),
    ({"prompt": "x", "min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"prompt": "x", "min_p": -0.1}, "min_p", "greater than or equal to 0"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty", "finite in float32"),
    ({"prompt": "x", "temperature": 1e300}, "temperature", "float32"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
    ({"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty", "valid number"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "less than or equal to 100"),
    ({"prompt": "x", "logit_bias": {"5": "big"}}, "logit_bias", "valid number"),
    ({"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"1" * 5000: 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"151669": 1}}, "logit_bias", "[0, 151669)"),  # refused by the engine
    ({"prompt": "x", "logit_bias": [1, 2]}, "logit_bias", "valid dictionary"),
    ({"prompt": "x", "stop": ""}, "stop", "non-empty"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "non-empty"),
    ({"prompt": "x", "stop": 5}, "stop", "none of the accepted types"),
    ({"prompt": "x", "stop": ["a", 5]}, "stop", "none of the accepted types"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available with stream=true"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens=2"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "bad_words": [" "]}, "bad_words", "non-blank"),
    ({"prompt": "x", "bad_words": "word"}, "bad_words", "valid list"),
    ({"prompt": "x", "include_stop_str_in_output": "maybe"}, "include_stop_str_in_output", "valid boolean"),
    ({"prompt": "x", "ignore_eos": 2}, "ignore_eos", "valid boolean"),
    ({"prompt": "x", "skip_special_tokens": []}, "skip_special_tokens", "valid boolean"),
    ({"prompt": "x", "user": 5}, "user", "valid string"),
    ({"prompt": "x", "min_tokens": 10**30}, "min_tokens", "less than 9223372036854775808"),
    ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids", "less than 9223372036854775808"),
    ({"prompt": "x", "presence_penalty": 1e300}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "logit_bias": {"5": 1e300}}, "logit_bias", "less than or equal to 100"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_COMPLETIONS)
def test_bad_completion_fields_are_a_400_naming_the_field(server: HTTPServer, body: dict, param: str,
                                                          message: str) -> None:
    response = post(server, "/v1/completions", {"model": "tiny", "max_tokens": 2, **body} if "max_tokens" not in body
                    and body else body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"] and error["message"].startswith(param), error


BAD_CHATS = [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": "hello"}, "messages", "valid list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages",
     "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ({"messages": [{"role": "user"}]}, "messages", "content is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages",
     "none of the accepted types"),
    ({"messages": CHAT, "max_completion_tokens": -5}, "max_completion_tokens", "greater than or equal to 1"),
    # vLLM's rule: tool_choice "auto" (the default with tools) needs the server's flags, which this one lacks
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     '"auto" (the default when tools are given) needs a server started with --enable-auto-tool-choice and '
     "--tool-call-parser NAME"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ({"messages": CHAT, "logprobs": "maybe"}, "logprobs", "valid boolean"),
    ({"messages": CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ({"messages": CHAT, "stop": [""]}, "stop", "non-empty"),
    ({"messages": CHAT, "max_tokens": 4, "min_tokens": 9}, "min_tokens", "max_tokens=4"),
    ({"messages": CHAT, "max_completion_tokens": 3, "min_tokens": 9}, "min_tokens", "max_completion_tokens=3"),
    ({"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream=true"),
    ({"messages": CHAT, "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}},
     "response_format", "none of the accepted types"),
    ({"messages": CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "only one structured-output field may be set, got response_format and guided_regex"),
    ({"messages": CHAT, "guided_choice": []}, "guided_choice", "non-empty list"),
    ({"messages": CHAT, "structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs",
     "exactly one of"),
]


def test_openai_platform_fields_are_accepted_on_chat_and_change_nothing(server: HTTPServer) -> None:
    """`store`, `metadata` and `service_tier` (OpenAI's stored completions and tiers) were unknown fields, a 400."""
    body = {"model": "tiny", "messages": CHAT, "max_completion_tokens": 3, "temperature": 0.0}
    plain = post(server, "/v1/chat/completions", body)
    tagged = post(server, "/v1/chat/completions",
                  {**body, "store": False, "metadata": {"run": "a"}, "service_tier": "auto"})
    assert plain.status_code == tagged.status_code == 200, tagged.text
    assert tagged.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    response = post(server, "/v1/chat/completions", {**body, "metadata": {"run": 1}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "metadata", response.text


@pytest.mark.parametrize(("body", "param", "message"), BAD_CHATS)
def test_bad_chat_fields_are_a_400_naming_the_field(server: HTTPServer, body: dict, param: str, message: str) -> None:
    response = post(server, "/v1/chat/completions", {"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize(("field", "value", "starts"), [
    ("structured_outputs", {"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ("guided_regex", "", "guided_regex: structured_outputs.regex must be a non-empty string"),
    ("guided_json", False, "guided_json: structured_outputs.json: the schema false accepts no document at all")])
def test_a_bad_structured_output_names_its_field_once(server: HTTPServer, field: str, value: object,
                                                      starts: str) -> None:
    response = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, field: value})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(starts), response.text


def deep_schema(levels: int) -> dict:
    """An object schema with `levels` objects inside one another (two dicts a level: the schema, its properties)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(("field", "value"), [
    ("guided_json", deep_schema(240)),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(240)}}),
    ("structured_outputs", {"json": {"type": "array", "items": deep_schema(200)}})])
def test_a_deeply_nested_schema_is_a_400_not_a_500(server: HTTPServer, field: str, value: object) -> None:
    """A 14 KB schema nested 240 objects deep overflowed Python's stack while the request was converted (500,
    RecursionError, and thousands of lines of traceback in the log; a fresh user's trial)."""
    response = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "more than 64 levels deep" in error["message"], error


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "x", "max_tokens": -Infinity}', "max_tokens"), (b'{"prompt": "x", "top_p": NaN}', "top_p"),
    (b'{"prompt": "x", "min_p": NaN}', "min_p"),
    (b'{"prompt": "x", "frequency_penalty": Infinity}', "frequency_penalty"),
    (b'{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
    (b'{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
    (b'{"prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias"), (b'{"prompt": "x", "n": NaN}', "n"),
    (b'{"prompt": "x", "top_k": Infinity}', "top_k"), (b'{"prompt": "x", "logprobs": NaN}', "logprobs"),
])
def test_nan_and_infinite_numbers_are_refused_naming_the_field(server: HTTPServer, raw: bytes, param: str) -> None:
    response = post(server, "/v1/completions", raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    assert "finite number" in error["message"] or "valid integer" in error["message"]


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": "x",', "not valid JSON"), (b"", "body is empty"), (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"), (b"\xff\xfe", "not valid JSON")])
def test_a_body_that_is_not_a_json_object_is_a_400(server: HTTPServer, raw: bytes, message: str) -> None:
    response = post(server, "/v1/completions", raw)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_a_json_body_sent_as_text_plain_is_a_400_naming_the_content_type(server: HTTPServer) -> None:
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers={"Content-Type": "text/plain"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == ("the request body must be a JSON object sent with Content-Type: "
                                                   "application/json, got Content-Type: text/plain"), response.text


def test_text_with_a_lone_surrogate_is_a_400_naming_the_field(server: HTTPServer) -> None:
    response = post(server, "/v1/completions", b'{"prompt": "bad \\ud800 text", "max_tokens": 2}')
    assert response.status_code == 400
    assert "lone surrogate" in response.json()["error"]["message"]


def test_a_50_mb_body_is_refused_with_413_before_it_is_read(server: HTTPServer) -> None:
    body = b'{"prompt": "' + b"a" * (50 << 20) + b'"}'
    t0 = time.monotonic()
    response = post(server, "/v1/completions", body)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 30


def test_a_body_without_content_length_over_the_limit_is_refused(server: HTTPServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * (1 << 20)
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=120,
                          headers={"Content-Type": "application/json", **server.headers})
    assert response.status_code == 413


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_a_missing_or_wrong_api_key_is_a_401_on_every_v1_route(server: HTTPServer, headers: dict) -> None:
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "x"})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 200  # outside /v1: open


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(server: HTTPServer) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_an_unknown_model_is_a_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model" and "'gpt-4o'" in err.value.body["message"]
    assert err.value.body["code"] == "model_not_found"


def test_unknown_routes_and_methods_answer_openai_errors(server: HTTPServer) -> None:
    missing = httpx.get(f"{server.url}/v1/nothing-here", headers=server.headers)
    assert missing.status_code == 404 and "no route" in missing.json()["error"]["message"]
    wrong = httpx.get(f"{server.url}/v1/completions", headers=server.headers)
    assert wrong.status_code == 405 and "GET is not allowed" in wrong.json()["error"]["message"]


def test_the_server_keeps_serving_after_every_bad_request(client: openai.OpenAI, server: HTTPServer) -> None:
    for body, _, _ in BAD_COMPLETIONS:
        assert post(server, "/v1/completions", body).status_code == 400
    for body, _, _ in BAD_CHATS:
        assert post(server, "/v1/chat/completions", body).status_code == 400
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert "Traceback" not in server.stderr()


# ---------------------------------------------------------------------------------------------- aborts, metrics
def test_a_client_that_disconnects_mid_stream_has_its_request_aborted_and_its_blocks_freed(
        server: HTTPServer) -> None:
    before = server.wait_metrics(idle)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers,
                      timeout=120) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        running = server.metrics()
        assert running["deltaserve:num_requests_running"] == 1 and running["deltaserve:kv_cache_usage_perc"] > 0
    after = server.wait_metrics(lambda m: idle(m) and m["deltaserve:request_success_total{finished_reason=abort}"] >
                                before["deltaserve:request_success_total{finished_reason=abort}"])
    assert after["deltaserve:request_success_total{finished_reason=abort}"] == before[
        "deltaserve:request_success_total{finished_reason=abort}"] + 1
    assert after["deltaserve:generation_tokens_total"] - before["deltaserve:generation_tokens_total"] < 400


def test_a_client_that_leaves_a_stream_of_several_samples_has_every_sample_aborted(server: HTTPServer) -> None:
    before = server.wait_metrics(idle)
    key = "deltaserve:request_success_total{finished_reason=abort}"
    body = {"model": "tiny", "messages": CHAT, "n": 3, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "logprobs": True, "top_logprobs": 2}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers,
                      timeout=120) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        assert server.metrics()["deltaserve:kv_cache_usage_perc"] > 0
    after = server.wait_metrics(lambda m: idle(m) and m[key] > before[key])
    assert after[key] == before[key] + 1
    assert after["deltaserve:generation_tokens_total"] - before["deltaserve:generation_tokens_total"] < 3 * 400


def test_a_client_that_gives_up_on_a_non_streamed_request_has_it_aborted(server: HTTPServer) -> None:
    before = server.wait_metrics(idle)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=1.0)
    after = server.wait_metrics(lambda m: idle(m) and m["deltaserve:request_success_total{finished_reason=abort}"] >
                                before["deltaserve:request_success_total{finished_reason=abort}"])
    assert after["deltaserve:generation_tokens_total"] - before["deltaserve:generation_tokens_total"] < 400


def test_metrics_are_prometheus_text_whose_counters_move_as_requests_run(server: HTTPServer,
                                                                          client: openai.OpenAI) -> None:
    before = server.wait_metrics(idle)
    out = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=7,
                                    extra_body={"ignore_eos": True})
    after = server.wait_metrics(idle)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("deltaserve:generation_tokens_total") == 14
    assert moved("deltaserve:prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("deltaserve:request_success_total{finished_reason=length}") == 2
    assert moved("deltaserve:prefix_cache_queries_total") == out.usage.prompt_tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_decode_time_seconds"):
        assert moved(f"deltaserve:{name}_count") == 2, name
        assert after[f"deltaserve:{name}_bucket{{le=+Inf}}"] == after[f"deltaserve:{name}_count"]
    assert moved("deltaserve:time_per_output_token_seconds_count") == 12  # every token after each first
    assert moved("deltaserve:request_generation_tokens_sum") == 14
    assert after["deltaserve:num_preemptions_total"] >= 0 and not math.isnan(after["deltaserve:kv_cache_usage_perc"])


def test_a_repeated_prompt_is_a_prefix_cache_hit_in_metrics(server: HTTPServer, client: openai.OpenAI) -> None:
    prompt = list(range(1000, 1040))  # 2.5 blocks of 16: the first two are cached after the first request
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    before = server.wait_metrics(idle)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    after = server.wait_metrics(idle)
    assert out.usage.prompt_tokens_details.cached_tokens == 32
    assert after["deltaserve:prefix_cache_hits_total"] - before["deltaserve:prefix_cache_hits_total"] == 32
    assert 0 < after["deltaserve:gpu_prefix_cache_hit_rate"] <= 1


# ============================================================================ structured outputs
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def test_response_format_json_schema_gives_json_valid_against_the_schema(client: openai.OpenAI) -> None:
    import jsonschema

    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_reply_cut_before_its_schema_is_complete_says_so_beside_finish_reason_length(
        client: openai.OpenAI, server: HTTPServer) -> None:
    """A json_schema integer without `maximum` ran to max_tokens: finish "length" and invalid JSON, with nothing to
    tell it from a complete reply. A non-standard field, which the openai client keeps in `model_extra`, says so."""
    unbounded = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": unbounded}}
    cut = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=3,
                                         response_format=schema)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].model_extra["structured_output_incomplete"]
    stream = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=3, stream=True,
                                       extra_body={"response_format": schema})
    ends = [c.choices[0] for c in stream if c.choices and c.choices[0].finish_reason]
    assert [(e.finish_reason, e.model_extra.get("structured_output_incomplete")) for e in ends] == [("length", True)]
    whole = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert whole.choices[0].finish_reason == "stop"
    assert "structured_output_incomplete" not in whole.choices[0].model_extra
    deadline = time.monotonic() + 10
    while f"request {cut.id} stopped at max_tokens" not in server.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)  # the engine's log names the reply's id
    assert f"request {cut.id} stopped at max_tokens" in server.stderr()


def test_response_format_json_object_and_vllm_guided_fields_constrain_the_output(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=CHAT, temperature=1, seed=1, max_tokens=40,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10,
                                          extra_body={"guided_choice": ["alpha", "beta"]})
    assert chat.choices[0].message.content in ("alpha", "beta")
    done = client.completions.create(model="tiny", prompt="id:", max_tokens=10,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(done.choices[0].text) == 4 and done.choices[0].text.isdigit()
    # The schema true (any JSON document), as structured_outputs.json and response_format take it.
    anything = client.completions.create(model="tiny", prompt="v:", temperature=0, max_tokens=40,
                                         extra_body={"guided_json": True}).choices[0]
    if anything.finish_reason == "stop":
        json.loads(anything.text)
    else:
        assert anything.text.strip() and anything.text.lstrip()[0] in '{["-0123456789tfn', anything.text


def test_response_format_constrains_completions_too_as_in_vllm(client: openai.OpenAI) -> None:
    import jsonschema

    done = client.completions.create(model="tiny", prompt="A person:", temperature=0, max_tokens=60, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert done.choices[0].finish_reason == "stop", done.choices[0]
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"response_format": {"type": "json_object"}, "guided_regex": "a+"})
    assert err.value.body["param"] == "guided_regex"


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert err.value.body["param"] == "response_format"
    assert "the JSON schema cannot be compiled" in err.value.body["message"]
