"""Engine-wide request statistics, kept by the frontend (it sees every request of every client) and sent to
clients as `EngineStats` (an HTTP server renders them at /metrics).

Metric names and bucket bounds are vLLM's (docs.vllm.ai, "Production Metrics"), so that dashboards built
for vLLM read ours once the `vllm:` prefix is replaced by `deltaserve:`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence

from common.protocol import EngineStats, Histogram, SchedulerStats

# Bucket upper bounds, in seconds unless the name says tokens.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                  80.0)
LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's buckets for request lengths in tokens)."""
    bounds: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(m * scale))
        scale *= 10


class BucketCounts:
    """A histogram of observations in fixed buckets (`Histogram` on the wire)."""

    def __init__(self, name: str, upper_bounds: Sequence[float]) -> None:
        self.name = name
        self.upper_bounds = list(upper_bounds)
        self.counts = [0] * (len(self.upper_bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += 1  # v <= bound goes to that bound's bucket
        self.total += value

    def snapshot(self) -> Histogram:
        return Histogram(self.name, list(self.upper_bounds), list(self.counts), self.total)


class EngineStatsCollector:
    """Counts and per-request latencies of every request the frontend serves.

    Times are seconds of `time.time()`. What is observed when:
    - first token: prompt tokens (its prefill is done), time to first token;
    - every later token: the time since the request's previous token (time per output token);
    - finish (stop, length or abort; not a rejected request): end-to-end latency, queue time (arrival to
      first scheduled), prefill time (first scheduled to first token), decode time (first to last token),
      inference time (first scheduled to finish), the request's mean time per output token, prompt and
      generation lengths.
    """

    def __init__(self, max_model_len: int) -> None:
        tokens = token_buckets(max_model_len)
        self.ttft = BucketCounts("time_to_first_token_seconds", TTFT_BUCKETS_S)
        self.tpot = BucketCounts("time_per_output_token_seconds", TPOT_BUCKETS_S)
        self.request_tpot = BucketCounts("request_time_per_output_token_seconds", TPOT_BUCKETS_S)
        self.e2e = BucketCounts("e2e_request_latency_seconds", LATENCY_BUCKETS_S)
        self.queue = BucketCounts("request_queue_time_seconds", LATENCY_BUCKETS_S)
        self.prefill = BucketCounts("request_prefill_time_seconds", LATENCY_BUCKETS_S)
        self.decode = BucketCounts("request_decode_time_seconds", LATENCY_BUCKETS_S)
        self.inference = BucketCounts("request_inference_time_seconds", LATENCY_BUCKETS_S)
        self.prompt_len = BucketCounts("request_prompt_tokens", tokens)
        self.generation_len = BucketCounts("request_generation_tokens", tokens)
        self.histograms = [self.ttft, self.tpot, self.request_tpot, self.e2e, self.queue, self.prefill, self.decode,
                           self.inference, self.prompt_len, self.generation_len]
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished: Counter[str] = Counter()
        self.scheduler: SchedulerStats | None = None

    def first_token(self, num_prompt_tokens: int, ttft_s: float) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self.ttft.observe(ttft_s)

    def finished(self, reason: str, num_prompt_tokens: int, num_output_tokens: int, e2e_s: float,
                 ttft_s: float | None, queue_s: float | None) -> None:
        """One request ended. `ttft_s` None: it produced no token; `queue_s` None: never scheduled."""
        self.num_finished[reason] += 1
        if reason == "error":  # rejected: its latency says nothing about serving
            return
        self.e2e.observe(e2e_s)
        self.prompt_len.observe(num_prompt_tokens)
        self.generation_len.observe(num_output_tokens)
        if queue_s is not None:
            self.queue.observe(queue_s)
            self.inference.observe(max(0.0, e2e_s - queue_s))
        if ttft_s is not None:
            if queue_s is not None:
                self.prefill.observe(max(0.0, ttft_s - queue_s))
            self.decode.observe(max(0.0, e2e_s - ttft_s))
            if num_output_tokens > 1:
                self.request_tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def snapshot(self, reply_id: int) -> EngineStats:
        return EngineStats(reply_id, self.scheduler, self.num_prompt_tokens, self.num_generation_tokens,
                           dict(self.num_finished), [h.snapshot() for h in self.histograms])
