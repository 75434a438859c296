"""/metrics: the engine's `EngineStats` as Prometheus text, made with prometheus-client.

The numbers come from the frontend (request counts, tokens, latency histograms) and the scheduler (running
and waiting requests, KV-cache blocks, preemptions, prefix-cache lookups), so every HTTP server process
(`--api-server-count`) shows the same engine-wide values, ZeroMQ clients' requests included. Names are
vLLM's with the prefix `deltaserve:` instead of `vllm:`; every series carries the label `model_name`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.protocol import EngineStats

PREFIX = "deltaserve:"
FINISH_REASONS = ("stop", "length", "abort")  # request_success_total's labels, as vLLM's
FAILED = "error"  # the engine's finish reason of a refused or failed request: request_failure_total instead

HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from arrival to the first output token, per request (seconds).",
    "time_per_output_token_seconds": "Time between two output tokens of a request, per token (seconds).",
    "request_time_per_output_token_seconds": "Mean time per output token after the first, per request (seconds).",
    "e2e_request_latency_seconds": "Time from arrival to finish, per request (seconds).",
    "request_queue_time_seconds": "Time from arrival to first being scheduled, per request (seconds).",
    "request_prefill_time_seconds": "Time from first being scheduled to the first token, per request (seconds).",
    "request_decode_time_seconds": "Time from the first token to finish, per request (seconds).",
    "request_inference_time_seconds": "Time from first being scheduled to finish, per request (seconds).",
    "request_prompt_tokens": "Prompt length, per finished request (tokens).",
    "request_generation_tokens": "Output length, per finished request (tokens).",
}


class _StatsCollector:
    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s, labels = self.stats, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        sched = s.scheduler
        running = sched.num_running if sched else 0
        waiting = sched.num_waiting if sched else 0
        usage = 1.0 - sched.num_free_blocks / sched.num_kv_blocks if sched and sched.num_kv_blocks else 0.0
        queries = sched.prefix_cache_queries if sched else 0
        hits = sched.prefix_cache_hits if sched else 0
        yield gauge("num_requests_running", "Requests holding KV-cache blocks, in the running batch.", running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).", waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by live requests (0 to 1).", usage)
        yield gauge("gpu_cache_usage_perc", "Same as kv_cache_usage_perc (vLLM v0's name).", usage)
        yield gauge("gpu_prefix_cache_hit_rate", "Prefix-cache hits over lookups since start, in tokens (0 to 1).",
                    hits / queries if queries else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache at first admission.",
                      queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache at first admission.", hits)
        yield counter("num_preemptions", "Requests preempted (their KV blocks freed, recomputed later).",
                      sched.num_preemptions if sched else 0)
        yield counter("prompt_tokens", "Prompt tokens of requests whose prefill finished.", s.num_prompt_tokens)
        yield counter("generation_tokens", "Output tokens generated.", s.num_generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Requests finished, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted((set(FINISH_REASONS) | set(s.num_finished)) - {FAILED}):
            success.add_metric([self.model_name, reason], s.num_finished.get(reason, 0))
        yield success
        yield counter("request_failure", "Requests refused or failed with an error (bad input the HTTP layer did "
                      "not catch, an engine failure); not in request_success.", s.num_finished.get(FAILED, 0))
        for h in s.histograms:
            family = HistogramMetricFamily(PREFIX + h.name, HISTOGRAM_HELP.get(h.name, h.name), labels=["model_name"])
            buckets, cumulative = [], 0
            for bound, count in zip([*h.upper_bounds, float("inf")], h.bucket_counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            family.add_metric(labels, buckets, h.total)
            yield family


def render(stats: EngineStats, model_name: str) -> tuple[bytes, str]:
    """(body, content type) of /metrics for `stats`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model_name))
    return generate_latest(registry), CONTENT_TYPE_LATEST
