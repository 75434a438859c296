"""The frontend's CPU time per full-batch decode step (a small model's budget: at most 0.5 ms at 256 rows), CPU only.

    python benchmarks/frontend_cpu.py [--model DIR] [--rows 256] [--steps 300]

The real `FrontendProcess` runs in this process over real ZeroMQ sockets (the benchmark holds the launcher's
and the scheduler's ends). `--rows` requests are submitted as one client's, then steps of one sampled token
per request are handed to its scheduler handler as encoded `StepOutputs`, the way the scheduler sends them.
The tokens are the model tokenizer's encoding of this repository's README, each request reading it from its
own offset, so the detokenizer sees text, not random ids (most random ids of a byte-level vocabulary are
parts of characters). Measured: the CPU time of this thread in `_handle_scheduler` (decode, detokenize, stop
strings, metrics, the outputs built and handed to ZeroMQ), per step, median and p90 over the `--steps` - 1
running steps, then the final step, in which every request ends (a request that is neither streamed nor
watched for stop strings is detokenized there, all at once), and the mean over all steps, the final one
included: the figure to hold against a per-step budget. Four kinds of request:

- plain: one output when finished (`LLM.generate`);
- stream: an output per step (the HTTP server streams);
- stop: plain with two stop strings that never occur;
- logprobs: plain with logprobs=5 (each step carries 5 top tokens per row).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ipc  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.protocol import (  # noqa: E402
    AddRequests,
    EngineReady,
    FinishedSeq,
    GenerateRequest,
    Logprobs,
    StepOutputs,
    Submit,
    encode,
    f32,
    i32,
)

KINDS = {
    "plain": ({}, False),
    "stream": ({}, True),
    "stop": ({"stop": ["<<never>>", "@@@@"]}, False),
    "logprobs": ({"logprobs": 5}, False),
}
TOP_N = 5
MIN_STEPS = 12  # a median and a p90 over the running steps past the first tenth
MAX_STEPS = 1000  # each request reads its tokens from its own offset in the README (about 2,400 tokens)


def text_tokens(tokenizer) -> list[int]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def step_logprobs(rows: int, tokens: np.ndarray, rng: np.random.Generator) -> Logprobs:
    """One position per row: the sampled token and `TOP_N` top tokens."""
    return Logprobs(rows=i32(np.arange(rows)), counts=i32(np.ones(rows)), num_top=i32(np.full(rows, TOP_N)),
                    token_logprobs=f32(-rng.random(rows)), ranks=i32(np.ones(rows)),
                    top_token_ids=i32(np.repeat(tokens, TOP_N)), top_logprobs=f32(-rng.random(rows * TOP_N)))


def measure(model: str, kind: str, rows: int, steps: int) -> list[float]:
    """Per-step CPU milliseconds of `_handle_scheduler` for `rows` requests of `kind`: `steps` steps, the last
    one ending every request."""
    from frontend.process import FrontendProcess

    sampling, stream = KINDS[kind]
    config = EngineConfig(model=model, max_model_len=steps + 64, max_num_seqs=rows)
    endpoints = ipc.Endpoints.create(1)
    ctx = zmq.Context.instance()
    control = ipc.make_socket(ctx, zmq.PULL, endpoints.control, bind=True)
    scheduler_in = ipc.make_socket(ctx, zmq.PULL, endpoints.scheduler_in, bind=True)
    frontend = FrontendProcess(config, endpoints)
    to_frontend = ipc.make_socket(ctx, zmq.PUSH, endpoints.frontend_in, bind=False)
    try:
        ipc.send(to_frontend, EngineReady(100_000, 16, {}))
        frontend.start()
        corpus = np.array(text_tokens(frontend.tokenizer), dtype=np.int64)
        params = {"max_tokens": steps, "ignore_eos": True, **sampling}
        frontend._submit(b"client", Submit([GenerateRequest(f"r{i}", prompt_token_ids=corpus[i:i + 32].tolist(),
                                                            sampling=params, stream=stream) for i in range(rows)]))
        added = ipc.recv(scheduler_in, timeout_ms=10_000)
        assert isinstance(added, AddRequests) and len(added.requests) == rows, added
        seq_ids = i32([r.seq_id for r in added.requests])
        rng = np.random.default_rng(0)
        offsets = rng.integers(0, len(corpus) - steps - 1, size=rows)
        times = []
        for step in range(steps):
            tokens = i32(corpus[offsets + step])
            logprobs = step_logprobs(rows, tokens, rng) if kind == "logprobs" else None
            last = step == steps - 1
            finished = [FinishedSeq(int(seq), "length") for seq in seq_ids] if last else []
            raw = encode(StepOutputs(step, seq_ids, tokens, finished=finished, logprobs=logprobs))
            t0 = time.thread_time()
            frontend._handle_scheduler(raw)
            times.append((time.thread_time() - t0) * 1e3)
            assert len(frontend.requests) == (0 if last else rows)
        return times
    finally:
        frontend.close()
        for sock in (control, scheduler_in, to_frontend):
            sock.close(linger=0)
        endpoints.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder, for its tokenizer (default: the demo model)")
    ap.add_argument("--rows", type=int, default=256, help="requests, one row each in every step (default 256)")
    ap.add_argument("--steps", type=int, default=300,
                    help=f"steps of one token a row, the last ending every request ({MIN_STEPS} to {MAX_STEPS}; "
                         "default 300)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default all)")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"--kinds: unknown {', '.join(map(repr, unknown))}; known: {', '.join(KINDS)}")
    if args.rows < 1:
        ap.error(f"--rows must be at least 1, got {args.rows}")
    if not MIN_STEPS <= args.steps <= MAX_STEPS:
        ap.error(f"--steps must be {MIN_STEPS} to {MAX_STEPS} (each request reads its tokens from the README), "
                 f"got {args.steps}")
    model = args.model
    if model is None:
        from frontend.default_model import ensure_default_model

        model = ensure_default_model()
    print(f"frontend CPU per decode step of {args.rows} rows ({args.steps} steps, the last ending every request; "
          "target: at most 0.5 ms)")
    for kind in kinds:
        times = measure(model, kind, args.rows, args.steps)
        running = times[:-1]
        warm = running[len(running) // 10:]  # the first steps fill the token caches
        p90 = statistics.quantiles(warm, n=10)[-1]
        print(f"{kind:10s} running: median {statistics.median(warm):.3f} ms, p90 {p90:.3f} ms "
              f"({1e3 * statistics.median(warm) / args.rows:.2f} us a row); final step {times[-1]:.2f} ms; "
              f"mean of all {statistics.fmean(times):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
