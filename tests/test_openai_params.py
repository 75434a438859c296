"""The OpenAI request -> SamplingParams mapping, and the engine-wide statistics behind /metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import EngineRequest, EngineStats, Histogram, SchedulerStats, i32
from common.sampling_params import SamplingParams
from frontend.openai.metrics import render
from frontend.openai.params import UnsupportedField, sampling_params
from frontend.openai.schema import ChatCompletionRequest, CompletionRequest
from frontend.stats import BucketCounts, EngineStatsCollector, token_buckets
from scheduler_proc.scheduler import Scheduler, SchedulerConfig

CHAT = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=CHAT, **fields)


def test_defaults_are_openais() -> None:
    completion = sampling_params(CompletionRequest(prompt="x"), max_model_len=4096)
    assert (completion.temperature, completion.max_tokens, completion.seed) == (1.0, 16, None)
    assert sampling_params(chat(), max_model_len=4096).max_tokens == 4096  # chat: as many as fit


def test_supported_fields_map_to_their_sampling_params() -> None:
    p = sampling_params(chat(temperature=0, max_tokens=9, seed=3, stop_token_ids=[5, 6], ignore_eos=True,
                             skip_special_tokens=False), max_model_len=100)
    assert (p.temperature, p.max_tokens, p.seed, p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == (
        0, 9, 3, [5, 6], True, False)
    assert sampling_params(chat(max_tokens=9, max_completion_tokens=4), 100).max_tokens == 4


def test_every_sampling_field_maps_to_its_sampling_params_name() -> None:
    p = sampling_params(chat(n=3, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
                             repetition_penalty=1.1, logit_bias={"7": -100, "12": 2.5}, bad_words=["x"], min_tokens=2,
                             stop="END", include_stop_str_in_output=True, logprobs=True, top_logprobs=3,
                             prompt_logprobs=1, user="someone", max_tokens=9), max_model_len=100)
    assert (p.n, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        3, 0.9, 40, 0.05, 0.5, -0.5, 1.1)
    assert p.logit_bias == {7: -100.0, 12: 2.5}  # OpenAI's string keys are token ids
    assert (p.bad_words, p.min_tokens, p.stop, p.include_stop_str_in_output) == (["x"], 2, ["END"], True)
    assert (p.logprobs, p.prompt_logprobs) == (3, 1)


def test_chat_logprobs_is_a_switch_and_top_logprobs_the_count() -> None:
    assert sampling_params(chat(logprobs=True), 100).logprobs == 0  # the sampled token's logprob alone
    assert sampling_params(chat(logprobs=True, top_logprobs=5), 100).logprobs == 5
    assert sampling_params(chat(logprobs=False), 100).logprobs is None
    assert sampling_params(chat(top_logprobs=0), 100).logprobs is None  # 0 without logprobs: allowed, nothing
    with pytest.raises(UnsupportedField, match="top_logprobs: needs logprobs=true") as err:
        sampling_params(chat(top_logprobs=2), 100)
    assert err.value.param == "top_logprobs"


def test_completion_logprobs_is_the_count_and_stop_a_string_or_a_list() -> None:
    p = sampling_params(CompletionRequest(prompt="x", logprobs=0, stop=["a", "bc"]), 100)
    assert (p.logprobs, p.stop) == (0, ["a", "bc"])
    assert sampling_params(CompletionRequest(prompt="x"), 100).logprobs is None


def test_prompt_logprobs_are_refused_with_stream_as_vllm_does() -> None:
    with pytest.raises(UnsupportedField, match="not available with stream=true") as err:
        sampling_params(CompletionRequest(prompt="x", prompt_logprobs=1, stream=True), 100)
    assert err.value.param == "prompt_logprobs"


def test_neutral_values_are_sampling_params_defaults() -> None:
    p = sampling_params(chat(n=1, top_p=1, top_k=-1, min_p=0, presence_penalty=0, frequency_penalty=0,
                             repetition_penalty=1, logit_bias={}, bad_words=[], min_tokens=0, stop=[],
                             include_stop_str_in_output=False, logprobs=False), max_model_len=100)
    assert p == SamplingParams(max_tokens=100, top_k=-1)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"stop": ""}, "stop", "stop must be a non-empty string"),
    ({"stop": ["a", ""]}, "stop", "stop must be a non-empty string"),
    ({"bad_words": [" "]}, "bad_words", "non-blank strings"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "min_tokens must be in [0, max_tokens=4]"),
    ({"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens", "min_tokens must be in [0, max_completion_tokens=4]"),
    ({"temperature": 1e39}, "temperature", "float32"),
    ({"repetition_penalty": 1e300}, "repetition_penalty", "finite in float32"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", "reciprocal"),
])
def test_values_sampling_params_refuse_are_named_by_the_request_field(fields: dict, param: str,
                                                                      message: str) -> None:
    with pytest.raises(UnsupportedField) as err:
        sampling_params(chat(**fields), max_model_len=100)
    assert err.value.param == param
    assert str(err.value).startswith(param) and message in str(err.value)


@pytest.mark.parametrize("key", ["hello", "-5", "1.5", " 7", "9223372036854775808", "1" * 5000, "\u0663"])
def test_logit_bias_keys_must_be_token_ids(key: str) -> None:
    with pytest.raises(UnsupportedField, match="keys must be token ids") as err:
        sampling_params(chat(logit_bias={key: 1.0}), 100)
    assert err.value.param == "logit_bias" and len(str(err.value)) < 200


# ---------------------------------------------------------------------------------------------- statistics
def test_an_observation_on_a_bound_counts_in_that_bound_s_bucket_as_prometheus_le_says() -> None:
    h = BucketCounts("x", [1.0, 2.0])
    for v in (0.5, 1.0, 1.5, 2.0, 9.0):
        h.observe(v)
    assert h.snapshot() == Histogram("x", [1.0, 2.0], [2, 2, 1], 14.0)


def test_token_buckets_are_1_2_5_per_decade_up_to_max_model_len() -> None:
    assert token_buckets(120) == (1, 2, 5, 10, 20, 50, 100)


def test_the_collector_observes_first_tokens_and_finished_requests_but_not_rejections() -> None:
    c = EngineStatsCollector(max_model_len=1000)
    c.first_token(num_prompt_tokens=10, ttft_s=0.2)
    c.finished("length", num_prompt_tokens=10, num_output_tokens=5, e2e_s=1.0, ttft_s=0.2, queue_s=0.05)
    c.finished("error", num_prompt_tokens=0, num_output_tokens=0, e2e_s=0.0, ttft_s=None, queue_s=None)
    snap = c.snapshot(reply_id=1)
    counts = {h.name: sum(h.bucket_counts) for h in snap.histograms}
    assert snap.num_prompt_tokens == 10 and snap.num_finished == {"length": 1, "error": 1}
    assert counts["e2e_request_latency_seconds"] == 1 and counts["request_queue_time_seconds"] == 1
    totals = {h.name: h.total for h in snap.histograms}
    assert totals["request_time_per_output_token_seconds"] == pytest.approx(0.2)  # (1.0 - 0.2) / 4
    assert totals["request_prefill_time_seconds"] == pytest.approx(0.15)
    assert totals["request_decode_time_seconds"] == pytest.approx(0.8)


def test_metrics_text_has_vllm_names_cumulative_buckets_and_kv_usage() -> None:
    stats = EngineStats(1, SchedulerStats(3, 2, 100, 75, 4, 200, 50), 11, 22, {"stop": 5},
                        [Histogram("time_to_first_token_seconds", [0.1, 1.0], [1, 2, 3], 9.0)])
    body, content_type = render(stats, "m")
    assert content_type.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    model = (("model_name", "m"),)
    assert samples[("deltaserve:num_requests_running", model)] == 3
    assert samples[("deltaserve:num_requests_waiting", model)] == 2
    assert samples[("deltaserve:kv_cache_usage_perc", model)] == 0.25
    assert samples[("deltaserve:gpu_prefix_cache_hit_rate", model)] == 0.25
    assert samples[("deltaserve:num_preemptions_total", model)] == 4
    assert samples[("deltaserve:generation_tokens_total", model)] == 22
    assert samples[("deltaserve:request_success_total", (("finished_reason", "stop"), ("model_name", "m")))] == 5
    assert samples[("deltaserve:request_success_total", (("finished_reason", "abort"), ("model_name", "m")))] == 0
    le = [(s.labels["le"], s.value) for f in text_string_to_metric_families(body.decode()) for s in f.samples
          if s.name == "deltaserve:time_to_first_token_seconds_bucket"]
    assert le == [("0.1", 1), ("1.0", 3), ("+Inf", 6)]


def test_scheduler_stats_count_running_waiting_blocks_and_prefix_hits() -> None:
    sched = Scheduler(SchedulerConfig(num_kv_blocks=8, block_size=4, max_model_len=64, max_num_seqs=1))
    prompt = list(range(10, 22))  # 3 full blocks
    for seq_id in (0, 1):
        assert sched.add_request(EngineRequest(seq_id, i32(prompt), 0.0, 4, None, [], 0.0)) == []
    sched.schedule()
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_kv_blocks, s.num_free_blocks) == (1, 1, 8, 5)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (12, 0)
    sched.abort([0])
    sched.schedule()  # admits request 1, whose first two blocks are cached (the last one is recomputed)
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.prefix_cache_queries, s.prefix_cache_hits) == (1, 0, 24, 8)


@pytest.mark.parametrize(("error_type", "status", "code"), [
    ("invalid_request", 400, None),
    ("engine_down", 503, "engine_unavailable"),
    ("overloaded", 503, "engine_overloaded"),  # --max-waiting-requests: the client may try again (it was a 500)
    (None, 500, None),
])
def test_an_engine_error_has_the_status_of_whose_fault_it_is(error_type: str | None, status: int,
                                                              code: str | None) -> None:
    from common.protocol import RequestOutput
    from frontend.openai.serving import engine_error

    out = RequestOutput("r", finished=True, finish_reason="error", error="the engine is overloaded: ...",
                        error_type=error_type)
    err = engine_error(out, "prompt")
    assert err.status == status and err.body()["error"]["code"] == code, err.body()
