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
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    with http_server(tiny_qwen3, tmp_path_factory.mktemp("http"), "--max-model-len", "512",
                     "--num-kvcache-blocks", str(NUM_KV_BLOCKS), "--served-model-name", "tiny", "tiny-alias") as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


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


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 2}, "n"),
    ({"stop": ["\n"]}, "stop"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"top_p": 0.5}, "top_p"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"frequency_penalty": -0.5}, "frequency_penalty"),
    ({"logit_bias": {"100": 5}}, "logit_bias"),
    ({"extra_body": {"top_k": 5}}, "top_k"),
    ({"extra_body": {"min_p": 0.1}}, "min_p"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 3}}, "min_tokens"),
])
def test_fields_the_engine_does_not_run_yet_are_refused_naming_them(client: openai.OpenAI, kwargs: dict,
                                                                     param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param
    assert "not supported yet" in err.value.body["message"] and err.value.body["message"].startswith(param)


@pytest.mark.parametrize(("kwargs", "param"), [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
                                               ({"logprobs": 2}, "logprobs"), ({"best_of": 2}, "best_of")])
def test_completion_echo_suffix_logprobs_are_refused_clearly(client: openai.OpenAI, kwargs: dict,
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
    ({"prompt": [[1], [-2]]}, "prompt", "none of the accepted types"),
    ({"prompt": []}, "prompt", "must not be an empty list"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": [151669]}, "prompt", "[0, 151669)"),
    ({"prompt": [2**63 - 1]}, "prompt", "[0, 151669)"),
    ({}, "prompt", "Field required"),
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
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "'system', 'developer', 'user' or 'assistant'"),
    ({"messages": [{"role": "user"}]}, "messages", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages",
     "none of the accepted types"),
    ({"messages": CHAT, "max_completion_tokens": -5}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}},
     "response_format", "none of the accepted types"),
    ({"messages": CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "only one structured-output field may be set, got response_format and guided_regex"),
    ({"messages": CHAT, "guided_choice": []}, "guided_choice", "non-empty list"),
    ({"messages": CHAT, "structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs",
     "exactly one of"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_CHATS)
def test_bad_chat_fields_are_a_400_naming_the_field(server: HTTPServer, body: dict, param: str, message: str) -> None:
    response = post(server, "/v1/chat/completions", {"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                                 b'{"prompt": "x", "max_tokens": -Infinity}'])
def test_nan_and_infinite_numbers_are_refused(server: HTTPServer, raw: bytes) -> None:
    response = post(server, "/v1/completions", raw)
    assert response.status_code == 400
    assert "finite number" in response.json()["error"]["message"] or "valid integer" in response.json()["error"][
        "message"]


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": "x",', "not valid JSON"), (b"", "body is empty"), (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"), (b"\xff\xfe", "not valid JSON")])
def test_a_body_that_is_not_a_json_object_is_a_400(server: HTTPServer, raw: bytes, message: str) -> None:
    response = post(server, "/v1/completions", raw)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


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
    for body, _, _ in BAD_COMPLETIONS[:5]:
        post(server, "/v1/completions", body)
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


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert err.value.body["param"] == "response_format"
    assert "the JSON schema cannot be compiled" in err.value.body["message"]
