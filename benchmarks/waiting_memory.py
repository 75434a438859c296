"""Memory of waiting requests: bytes the frontend and the scheduler hold per request that waits to start,
by prompt length, and what `--max-waiting-requests` keeps flat.

One request runs (`max_num_seqs` 1) and its worker is then stopped (SIGSTOP), so every request submitted after
it waits for good.
For each prompt length the script submits `--requests` of them and reads the growth of the two processes'
resident memory (VmRSS); then, with `max_waiting_requests` set to that count, it submits twice as many and
checks that the memory grows no more than for the first batch (the rest are refused at once).

    python benchmarks/waiting_memory.py --model DIR [--requests 20000] [--prompt-tokens 16 256 1024]

The model does not matter (nothing runs but one decode): a tiny random checkpoint does
(`tests/conftest.py: make_tiny_checkpoint`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from common.config import EngineConfig  # noqa: E402
from common.protocol import GenerateRequest  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from frontend.client import EngineClient  # noqa: E402
from frontend.launcher import EngineProcesses  # noqa: E402

BATCH = 1000  # requests per Submit


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib << 10


def settled_rss(pids: dict[str, int], quiet_s: float = 2.0) -> dict[str, int]:
    """Each process's RSS once it has stopped changing for `quiet_s` (the queue has been taken in)."""
    last = {name: rss_bytes(pid) for name, pid in pids.items()}
    still_since = time.monotonic()
    while time.monotonic() - still_since < quiet_s:
        time.sleep(0.25)
        now = {name: rss_bytes(pid) for name, pid in pids.items()}
        if any(abs(now[n] - last[n]) > 64 << 10 for n in now):
            still_since = time.monotonic()
        last = now
    return last


def measure(model: str, prompt_tokens: int, count: int, cap: int | None) -> tuple[dict[str, int], int]:
    """(RSS growth per process, requests refused) after submitting `count` waiting requests of
    `prompt_tokens` tokens to an engine capped at `cap` waiting requests."""
    config = EngineConfig(model=model, device="cpu", max_num_seqs=1, max_model_len=prompt_tokens + 2048,
                          max_waiting_requests=cap, num_kvcache_blocks=(prompt_tokens + 2048) // 16 + 2)
    engine = EngineProcesses(config)
    engine.start()
    client = EngineClient(engine.endpoints.client, liveness=engine.check, curve=engine.client_keys())
    try:
        runner = client.generate([1000, 1001], SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
        next(runner)  # the one running request: every later one waits, as long as it runs,
        os.kill(engine.procs["worker-tp0"].pid, signal.SIGSTOP)  # which is for ever (the watchdog is off)
        pids = {name: engine.procs[name].pid for name in ("frontend", "scheduler")}
        before = settled_rss(pids)
        rng = np.random.default_rng(0)
        params = SamplingParams(temperature=0.0, max_tokens=16).to_dict()
        for start in range(0, count, BATCH):
            ids = rng.integers(1000, 20000, size=(min(BATCH, count - start), prompt_tokens)).tolist()
            client.submit([GenerateRequest(client.new_request_id(), prompt_token_ids=p, sampling=params)
                           for p in ids])
        client.engine_info(timeout_s=600)  # answered once the frontend has taken in every submission before it
        refused = sum(o.finished for o in client.recv_outputs(timeout_s=0))  # the refusals came at once
        after = settled_rss(pids, quiet_s=5.0)  # the scheduler takes them in after the frontend
        runner.close()
        return {name: after[name] - before[name] for name in pids}, refused
    finally:
        client.close()
        engine.shutdown()


def main() -> None:
    os.environ["DELTASERVE_STEP_TIMEOUT_S"] = "0"  # the worker is stopped on purpose
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[16, 256, 1024])
    args = p.parse_args()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) << 10
    print(f"{args.requests} waiting requests per run; machine memory {total / 2**30:.1f} GiB")
    print("prompt tokens | frontend B/req | scheduler B/req | waiting requests in half the machine's memory")
    for n in args.prompt_tokens:
        grown, refused = measure(args.model, n, args.requests, None)
        per = {name: grown[name] / args.requests for name in grown}
        fits = int(total / 2 / max(1.0, sum(per.values())))
        print(f"{n:13d} | {per['frontend']:14.0f} | {per['scheduler']:15.0f} | {fits:,}", flush=True)
        assert refused == 0, refused
    n = args.prompt_tokens[0]
    grown, refused = measure(args.model, n, 2 * args.requests, args.requests)
    per = {name: grown[name] / args.requests for name in grown}
    print(f"with max_waiting_requests={args.requests} and {2 * args.requests} submitted ({n}-token prompts): "
          f"{refused} refused at once; growth per accepted request frontend {per['frontend']:.0f} B, "
          f"scheduler {per['scheduler']:.0f} B")


if __name__ == "__main__":
    main()
