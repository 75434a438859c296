"""Soak: does every engine process come back to the same resident memory, round after round?

Two series of rounds against one engine (CPU or GPU):
1. burst: one client submits `--requests` requests at once (`--prompt-tokens` random token ids each, `--max-tokens`
   greedy tokens, ignore_eos) and reads every output; each must have exactly `--max-tokens` tokens, and a fixed
   probe prompt must get the same greedy tokens every round. Every burst sends the same prompts, so that what the
   engine caches by content fills in round 1; with `--fresh-prompts` each burst's are new, and the scheduler's
   prefix-cache index (one entry per KV block holding a full prompt block, at most the cache's block count) grows
   with every round until the KV cache has cycled once;
2. unread: a client asks for `--unread-replies` replies of about `--reply-bytes` each (Detokenize of a long token,
   repeated), reads none of them (its receive queue is one message deep, so they pile up in the frontend), and
   disconnects.

After each round, once every process's RSS has stopped moving for `--settle-s`, it prints VmRSS (from
/proc/PID/status) of each engine process: frontend, scheduler, each worker rank (for an unread round also before
the client leaves, "queued": the frontend then holds its replies; after, it must have dropped them), and after each
series the peak so far (VmHWM). At the end, for each series and
process: the growth from round 2 to the last round, which must stay within `--max-growth` (5%): memory that
comes back to the same size every round is kept by the allocator for reuse; memory that grows every round is a
leak.

    python benchmarks/soak.py --model DIR [--device cpu|cuda] [--rounds 10] [--requests 10000]
        [--unread-rounds 10] [--unread-replies 300] [--reply-bytes 1000000] [--max-tokens 8]
    python benchmarks/soak.py --model DIR --rounds 3 --requests 1000 --unread-rounds 3    # small: tests/test_soak.py

`--malloc-tunables` starts the engine with glibc's malloc set to hand freed memory back at once (trim threshold 0,
mmap threshold 64 KiB, 2 arenas; GLIBC_TUNABLES): a growth that vanishes then was the allocator's, not a leak.
Exits with status 1 if a process grew more than `--max-growth`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from benchmarks.waiting_memory import settled_rss  # noqa: E402
from common import ipc  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.protocol import (  # noqa: E402
    Detokenize,
    EngineStats,
    GenerateRequest,
    GetEngineStats,
    Submit,
    decode,
)
from common.sampling_params import SamplingParams  # noqa: E402
from frontend.client import EngineClient  # noqa: E402
from frontend.launcher import EngineProcesses  # noqa: E402
from frontend.validation import load_tokenizer  # noqa: E402

BATCH = 1000  # requests per Submit
PROBE_PROMPT = [1000, 2000, 3000, 4000]
MALLOC_TUNABLES = "glibc.malloc.trim_threshold=0:glibc.malloc.mmap_threshold=65536:glibc.malloc.arena_max=2"


@dataclass
class Series:
    """RSS (bytes) of each engine process after each round of one kind."""

    kind: str
    rounds: list[dict[str, int]] = field(default_factory=list)

    def growth(self, first_round: int = 2) -> dict[str, float]:
        """Each process's growth from round `first_round` (1-based) to the last, as a fraction of the former."""
        start, end = self.rounds[first_round - 1], self.rounds[-1]
        return {name: (end[name] - start[name]) / start[name] for name in start}


def burst(client: EngineClient, count: int, prompt_tokens: int, max_tokens: int, rng: np.random.Generator) -> float:
    """Submit `count` requests at once and read every output; requests per second. Raises `AssertionError` for an
    output that is not `max_tokens` tokens long."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True).to_dict()
    t0 = time.monotonic()
    pending = set()
    for start in range(0, count, BATCH):
        ids = rng.integers(1000, 20000, size=(min(BATCH, count - start), prompt_tokens)).tolist()
        requests = [GenerateRequest(client.new_request_id(), prompt_token_ids=p, sampling=params) for p in ids]
        pending.update(r.request_id for r in requests)
        client.submit(requests)
    while pending:
        for out in client.recv_outputs(timeout_s=600):
            if out.finished:
                assert out.error is None and len(out.token_ids) == max_tokens, out
                pending.discard(out.request_id)
    return count / (time.monotonic() - t0)


def ask_stats(sock: zmq.Socket, reply_id: int) -> EngineStats:
    """The engine's stats, asked on a raw DEALER `sock` (other replies are skipped)."""
    ipc.send(sock, GetEngineStats(reply_id))
    while True:
        assert sock.poll(60_000), "the engine did not answer GetEngineStats within 60 s"
        msg = decode(sock.recv())
        if isinstance(msg, EngineStats) and msg.reply_id == reply_id:
            return msg


def unread(address: str, curve: object, control: zmq.Socket, replies: int, token_id: int, repeat: int,
           pids: dict[str, int], settle_s: float) -> dict[str, int]:
    """A client that asks for `replies` Detokenize answers of `repeat` copies of `token_id`, reads none, and
    disconnects once the frontend has answered them all (their answers are queued to it by then: the frontend
    takes one client's messages in order, and the last one, a request with an empty prompt, is refused with an
    error that the engine's stats count). Returns the processes' RSS just before it disconnects."""
    sock = ipc.make_socket(zmq.Context.instance(), zmq.DEALER, address, bind=False, curve=curve)
    sock.setsockopt(zmq.RCVHWM, 1)
    before = ask_stats(control, 1).num_finished.get("error", 0)
    ids = [token_id] * repeat
    for i in range(replies):
        ipc.send(sock, Detokenize(i, ids))
    ipc.send(sock, Submit([GenerateRequest("last", prompt_token_ids=[])]))
    deadline = time.monotonic() + 600
    while ask_stats(control, 2).num_finished.get("error", 0) == before:
        assert time.monotonic() < deadline, "the frontend did not reach the unread client's last message"
        time.sleep(0.05)
    queued = settled_rss(pids, settle_s)
    sock.close(linger=0)
    return queued


def longest_token(tokenizer: object) -> tuple[int, int]:
    """(token id, characters of its text) of the token whose text is longest."""
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    token_id = max(vocab.values(), key=lambda i: len(tokenizer.decode([i])))  # type: ignore[attr-defined]
    return token_id, len(tokenizer.decode([token_id]))  # type: ignore[attr-defined]


def peak_rss(pids: dict[str, int]) -> dict[str, int]:
    """Each process's highest RSS so far (VmHWM), in bytes."""
    peaks = {}
    for name, pid in pids.items():
        with open(f"/proc/{pid}/status") as f:
            peaks[name] = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) << 10
    return peaks


def rss_line(label: str, rss: dict[str, int]) -> str:
    return f"{label:>12} | " + " | ".join(f"{name} {rss[name] / 2**20:8.1f} MiB" for name in sorted(rss))


MIN_SETTLE_S = 2.5  # s: two of the engine processes' 1-second ticks and some slack


def soak(model: str, device: str = "cpu", rounds: int = 10, requests: int = 10_000, unread_rounds: int = 10,
         unread_replies: int = 300, reply_bytes: int = 1_000_000, prompt_tokens: int = 16, max_tokens: int = 8,
         settle_s: float = 3.0, fresh_prompts: bool = False, engine_kwargs: dict | None = None,
         out=print) -> dict[str, Series]:
    """Run both series against a fresh engine. Returns, by kind, the RSS of each process per round: "idle" (one
    round: before any), "burst", "unread" (after the client left) and "queued" (before it left, its replies
    queued). Every burst sends the same prompts unless `fresh_prompts`. `out` prints each line as it comes."""
    # Each process hands freed heap pages back at its once-a-second tick (common.proc.trim_heap), so a still RSS
    # means nothing until two ticks have passed: with 1 s, the first unread round once read the frontend before
    # its trim, still holding all 50 replies (CI, 2026-12-05).
    settle_s = max(settle_s, MIN_SETTLE_S)
    config = EngineConfig(model=model, device=device, **(engine_kwargs or {}))
    engine = EngineProcesses(config)
    info = engine.start()
    out(f"KV cache: {info['num_kv_blocks']} blocks of {info['block_size']} tokens; {requests} requests of "
        f"{prompt_tokens} prompt tokens a burst")
    curve = engine.client_keys()
    client = EngineClient(engine.endpoints.client, liveness=engine.check, curve=curve)
    control = ipc.make_socket(zmq.Context.instance(), zmq.DEALER, engine.endpoints.client, bind=False, curve=curve)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        pids = {name: p.pid for name, p in engine.procs.items()}
        probe = [o.token_ids for o in client.generate(PROBE_PROMPT, greedy) if o.finished][0]
        series = {kind: Series(kind) for kind in ("idle", "burst", "queued", "unread")}
        series["idle"].rounds.append(settled_rss(pids, settle_s))
        out(rss_line("idle", series["idle"].rounds[-1]))
        for r in range(rounds):
            rng = np.random.default_rng(r if fresh_prompts else 0)
            rate = burst(client, requests, prompt_tokens, max_tokens, rng)
            assert [o.token_ids for o in client.generate(PROBE_PROMPT, greedy) if o.finished][0] == probe
            series["burst"].rounds.append(settled_rss(pids, settle_s))
            out(rss_line(f"burst {r + 1}", series["burst"].rounds[-1]) + f" | {rate:.0f} req/s")
        if rounds:
            out(rss_line("peak so far", peak_rss(pids)))
        token_id, chars = longest_token(load_tokenizer(config.tokenizer or model))
        for r in range(unread_rounds):
            series["queued"].rounds.append(unread(engine.endpoints.client, curve, control, unread_replies, token_id,
                                                  max(1, reply_bytes // chars), pids, settle_s))
            out(rss_line(f"queued {r + 1}", series["queued"].rounds[-1]))
            series["unread"].rounds.append(settled_rss(pids, settle_s))
            out(rss_line(f"unread {r + 1}", series["unread"].rounds[-1]))
        if unread_rounds:
            out(rss_line("peak so far", peak_rss(pids)))
        assert [o.token_ids for o in client.generate(PROBE_PROMPT, greedy) if o.finished][0] == probe
        return series
    finally:
        control.close()
        client.close()
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=10, help="burst rounds")
    p.add_argument("--requests", type=int, default=10_000, help="requests per burst")
    p.add_argument("--unread-rounds", type=int, default=10)
    p.add_argument("--unread-replies", type=int, default=300)
    p.add_argument("--reply-bytes", type=int, default=1_000_000)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--settle-s", type=float, default=3.0, help="RSS still for this long ends a round (at least 2.5)")
    p.add_argument("--max-growth", type=float, default=0.05, help="allowed growth from round 2 to the last")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--num-kvcache-blocks", type=int, default=None, help="the KV cache's size (default: the engine's)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="new prompts every burst: the prefix cache's index then grows until the KV cache has cycled")
    p.add_argument("--malloc-tunables", action="store_true", help=f"GLIBC_TUNABLES={MALLOC_TUNABLES}")
    args = p.parse_args()
    if args.malloc_tunables:
        os.environ["GLIBC_TUNABLES"] = MALLOC_TUNABLES  # inherited by the engine's processes, not this one
    series = soak(args.model, args.device, args.rounds, args.requests, args.unread_rounds, args.unread_replies,
                  args.reply_bytes, args.prompt_tokens, args.max_tokens, args.settle_s, args.fresh_prompts,
                  {"max_model_len": args.max_model_len, "num_kvcache_blocks": args.num_kvcache_blocks,
                   "enable_prefix_caching": not args.no_prefix_caching}, out=lambda line: print(line, flush=True))
    failed = False
    for s in (series["burst"], series["unread"]):
        if len(s.rounds) < 3:
            continue
        growth = s.growth()
        print(f"{s.kind}: growth from round 2 to round {len(s.rounds)}: "
              + ", ".join(f"{name} {g:+.1%}" for name, g in sorted(growth.items())))
        failed |= any(g > args.max_growth for g in growth.values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
