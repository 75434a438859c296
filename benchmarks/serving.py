"""An online serving benchmark over HTTP, in the manner of `vllm bench serve`; works against any
OpenAI-compatible server (deltaserve, vLLM, SGLang, ...), so one command measures each.

Requests arrive as a Poisson process at `--request-rate` per second (gamma-distributed gaps with
`--burstiness` != 1; `inf`: all at once), at most `--max-concurrency` in flight. Each streams its answer
(`stream_options.include_usage`); the client records the time to the first token (TTFT), the time per
output token after it (TPOT), the gap between streamed chunks (ITL) and the end-to-end latency (E2EL), and
prints request throughput, output tokens/s, and each latency's mean, median, p90 and p99.

Workloads (`--dataset`):
- `random`: prompt token ids uniform in 0..10000, lengths uniform in input_len * [1 - r, 1 + r] (and output
  lengths likewise), r = `--range-ratio`; `--range-ratio 0` makes every request the same length;
- `reference`: nano-vllm's bench.py workload (random.seed(0), 256 requests, prompt and output lengths uniform
  in 100..1024, token ids in 0..10000, temperature 0.6), sent as a burst: benchmarks/throughput.py runs the same
  requests offline through `LLM.generate`, for the HTTP overhead.
Prompts are token-id lists sent to /v1/completions with `ignore_eos` (a vLLM extension, as in `vllm bench
serve`; `--no-ignore-eos` for servers without it); `--endpoint chat` sends text of random words instead.

    python launch.py --model DIR --http-port 8000 --max-model-len 4096 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --dataset reference
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 1000 --input-len 512 \\
        --output-len 128 --request-rate 4 16 64
    python benchmarks/serving.py --launch DIR ...    # start deltaserve itself, measure, stop it

With `--launch`, it also prints the CPU time each server process used per wall second of the run, and the HTTP
server processes' CPU microseconds per output token: a process near 1.0 CPU s per s cannot keep up, and
`--launch-arg=--api-server-count=2` is worth measuring.

`--client-processes N` spreads the requests over N client processes (each with its own event loop), so that a
fast server is not measured by a slow client. `--offline DIR` runs the same requests through `LLM.generate`
instead (no HTTP; a burst, or one request at a time with `--max-concurrency 1`), with TTFT and TPOT as the
engine measures them: the figures the HTTP runs are compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
         "woman", "place", "work", "week", "case", "point", "number", "group", "problem", "fact", "river")


@dataclass
class Request:
    index: int
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int
    arrival_s: float  # offset from the start of the run


@dataclass
class Result:
    index: int
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    end_s: float = 0.0  # when it finished, from the start of the run
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    retries: int = 0  # resent after a reused keep-alive connection failed before any byte of the response


# ---------------------------------------------------------------------------------------------- workload
def make_requests(args: argparse.Namespace, rate: float) -> list[Request]:
    if args.dataset == "reference":
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        outputs = [random.randint(100, 1024) for _ in range(256)]
    else:
        rng = np.random.default_rng(args.seed)
        r = args.range_ratio
        lens = rng.integers(max(1, int(args.input_len * (1 - r))), int(args.input_len * (1 + r)) + 1,
                            args.num_prompts)
        outputs = rng.integers(max(1, int(args.output_len * (1 - r))), int(args.output_len * (1 + r)) + 1,
                               args.num_prompts).tolist()
        prompts = [rng.integers(0, 10000, int(n)).tolist() for n in lens]
    if args.endpoint == "chat":  # about one token per word
        word = random.Random(args.seed)
        prompts = [" ".join(word.choice(WORDS) for _ in range(len(p))) for p in prompts]
    gaps = np.zeros(len(prompts)) if math.isinf(rate) else np.random.default_rng(args.seed + 1).gamma(
        args.burstiness, 1.0 / (rate * args.burstiness), len(prompts))
    arrivals = np.cumsum(gaps) - gaps[0]
    return [Request(i, p, len(p) if isinstance(p, list) else len(p.split()), int(o), float(t))
            for i, (p, o, t) in enumerate(zip(prompts, outputs, arrivals))]


def request_body(args: argparse.Namespace, model: str, req: Request) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


# ---------------------------------------------------------------------------------------------- client
# A pooled connection can be closed by the server just as a request is sent on it (its keep-alive timeout):
# the request is reset before it reached the server's app. Such a request is sent once more, on a new
# connection, as browsers do, and the retry is counted and reported. A failure on a new connection, or after
# any byte of the response arrived, is a failed request.
STALE_CONNECTION_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


async def send(http: httpx.AsyncClient, path: str, body: dict[str, Any], req: Request, t_start: float) -> Result:
    """One streamed request, retried once if it failed unanswered on a reused connection; TTFT and E2EL
    count from the first attempt."""
    t0 = time.perf_counter()
    for retries in (0, 1):
        new_connection = False

        async def trace(event: str, info: dict[str, Any]) -> None:
            nonlocal new_connection
            new_connection = new_connection or event.startswith("connection.connect_tcp.")

        res = Result(req.index, prompt_len=req.prompt_len, retries=retries)
        try:
            async with http.stream("POST", path, json=body, extensions={"trace": trace}) as response:
                await read_stream(response, res, t0, t_start)
            return res
        except STALE_CONNECTION_ERRORS as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            if new_connection or retries:
                return res
        except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            return res
    raise AssertionError("unreachable")


async def read_stream(response: httpx.Response, res: Result, t0: float, t_start: float) -> None:
    """Fill `res` from a streamed completion; an error raised here (the response has started) is not retried."""
    last = t0
    chunks = 0
    try:
        if response.status_code != 200:
            res.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                res.error = str(data["error"])
                return
            if data.get("usage") and not data.get("choices"):
                res.output_tokens = data["usage"]["completion_tokens"]
                continue
            choice = data["choices"][0] if data.get("choices") else {}
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if not text:
                continue
            now = time.perf_counter()
            if chunks == 0:
                res.ttft_s = now - t0
            else:
                res.itl_s.append(now - last)
            last = now
            chunks += 1
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return
    res.e2e_s = time.perf_counter() - t0
    res.end_s = time.time() - t_start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True


def ensure_open_files(connections: int, margin: int = 64) -> None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit when `connections` sockets (and `margin`
    other files) would not fit; SystemExit naming the limit when even the hard limit is too low."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + margin
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"{connections} connections in one client process need about {needed} open files, but "
                         f"RLIMIT_NOFILE's hard limit is {hard}: raise it (ulimit -Hn), lower --max-concurrency or "
                         f"raise --client-processes")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_share(base_url: str, path: str, api_key: str | None, bodies: list[dict[str, Any]],
                    requests: list[Request], max_concurrency: int, t_start: float) -> list[Result]:
    """Send `requests` (this client process's share) at their arrival times; `t_start`: time.time() of t=0."""
    ensure_open_files(min(max_concurrency, len(requests)))
    limit = asyncio.Semaphore(max_concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(3600.0)) as http:
        async def one(body: dict[str, Any], req: Request) -> Result:
            delay = t_start + req.arrival_s - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                return await send(http, path, body, req, t_start)

        return await asyncio.gather(*(one(b, r) for b, r in zip(bodies, requests)))


def _client_process(job: tuple) -> list[dict[str, Any]]:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return [asdict(r) for r in asyncio.run(run_share(*job))]


def run_load(args: argparse.Namespace, model: str, rate: float) -> tuple[list[Result], float]:
    requests = make_requests(args, rate)
    bodies = [request_body(args, model, r) for r in requests]
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    n = max(1, args.client_processes)
    per_process = max(1, math.ceil(args.max_concurrency / n))
    t_start = time.time() + 1.0 + 0.2 * n  # every client process is up before the first arrival
    jobs = [(args.base_url, path, args.api_key, bodies[i::n], requests[i::n], per_process, t_start)
            for i in range(n)]
    if n == 1:
        results = asyncio.run(run_share(*jobs[0]))
    else:
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            results = [Result(**r) for share in pool.map(_client_process, jobs) for r in share]
    duration = max((r.end_s for r in results if r.ok), default=0.0)
    return sorted(results, key=lambda r: r.index), duration


def run_offline(args: argparse.Namespace, llm: Any) -> tuple[list[Result], float]:
    """The requests through `llm.generate`, all at once or, with max_concurrency 1, one after another."""
    from deltaserve import SamplingParams

    requests = make_requests(args, math.inf)
    params = [SamplingParams(temperature=args.temperature, max_tokens=r.max_tokens, ignore_eos=args.ignore_eos)
              for r in requests]
    groups = [[i] for i in range(len(requests))] if args.max_concurrency == 1 else [list(range(len(requests)))]
    results: list[Result] = []
    t0 = time.perf_counter()
    for group in groups:
        outs = llm.generate([requests[i].prompt for i in group], [params[i] for i in group], use_tqdm=False)
        for i, out in zip(group, outs):
            m = out["metrics"]
            results.append(Result(i, ok=out["error"] is None, error=out["error"] or "",
                                  prompt_len=requests[i].prompt_len, output_tokens=len(out["token_ids"]),
                                  ttft_s=m.get("ttft_s", 0.0), e2e_s=m.get("e2e_s", 0.0),
                                  end_s=time.perf_counter() - t0))
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- report
def summarize(results: list[Result], duration_s: float, rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl_s]
    summary: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(rate) else rate, "completed": len(ok), "failed": len(results) - len(ok),
        "retried": sum(r.retries for r in results),
        "duration_s": duration_s, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
    }
    for name, values in (("ttft", [r.ttft_s for r in ok]), ("tpot", tpot), ("itl", itl),
                         ("e2el", [r.e2e_s for r in ok])):
        ms = np.asarray(values) * 1e3 if values else np.zeros(1)
        summary.update({f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                        f"p90_{name}_ms": float(np.percentile(ms, 90)), f"p99_{name}_ms": float(np.percentile(ms, 99))})
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def print_summary(s: dict[str, Any]) -> None:
    print(f"{'=' * 20} Serving benchmark (request rate {s['request_rate']}) {'=' * 20}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Retried (stale keep-alive connection)", s["retried"]),
            ("Benchmark duration (s)", s["duration_s"]), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    for label, value in rows:
        print(f"{label:<40}{value:>14.2f}" if isinstance(value, float) else f"{label:<40}{value:>14}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{'-' * 20} {title} {'-' * 20}")
        for stat in ("mean", "median", "p90", "p99"):
            print(f"{stat.capitalize() + ' ' + name.upper() + ' (ms)':<40}{s[f'{stat}_{name}_ms']:>14.2f}")
    if "first_error" in s:
        print(f"first error: {s['first_error']}")


# ---------------------------------------------------------------------------------------------- main
def server_processes(launcher_pid: int) -> dict[str, int]:
    """Process title ("deltaserve-http-0", ...) -> pid, for the children of `launcher_pid`."""
    out = {}
    for status in os.scandir("/proc"):
        if not status.name.isdigit():
            continue
        try:
            with open(f"/proc/{status.name}/status") as f:
                if f"\nPPid:\t{launcher_pid}\n" not in f.read():
                    continue
            with open(f"/proc/{status.name}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode().split()
        except OSError:
            continue
        if title and title[0].startswith("deltaserve-"):
            out[title[0][len("deltaserve-"):]] = int(status.name)
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    sys.path.insert(0, REPO)
    from benchmarks.proc_stats import cpu_seconds as one

    return {name: one(pid) for name, pid in pids.items()}


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start `launch.py --model LAUNCH --http-port PORT` and wait until it serves."""
    sys.path.insert(0, REPO)
    from common.ipc import free_port

    port = free_port()
    cmd = [sys.executable, os.path.join(REPO, "launch.py"), "--model", args.launch, "--http-port", str(port),
           "--max-model-len", str(args.max_model_len), *args.launch_arg]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # launch.py's status lines, the serving banner among them
        print(line, end="", file=sys.stderr)
        if line.startswith("deltaserve: serving "):
            threading.Thread(target=lambda: sys.stderr.writelines(proc.stderr), daemon=True).start()
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"the server exited with code {proc.wait()} before serving")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--launch", default=None, metavar="MODEL_DIR", help="start deltaserve on this model first")
    p.add_argument("--launch-arg", action="append", default=[],
                   help="one extra launch.py word per use: --launch-arg=--api-server-count=2, or "
                        "--launch-arg=--flag --launch-arg=VALUE")
    p.add_argument("--offline", default=None, metavar="MODEL_DIR",
                   help="no HTTP: the same requests through LLM.generate on this model (burst, or --max-concurrency 1)")
    p.add_argument("--max-model-len", type=int, default=4096, help="with --launch")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", choices=("random", "reference"), default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="requests per second (several: a sweep); inf = all at once (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; < 1 burstier, > 1 steadier")
    p.add_argument("--max-concurrency", type=int, default=1024, help="most requests in flight")
    p.add_argument("--temperature", type=float, default=None, help="default 0.6 for reference, else 0")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--client-processes", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before each run")
    p.add_argument("--json", default=None, help="write the summaries (a list, one per rate) to this file")
    args = p.parse_args()
    if args.temperature is None:
        args.temperature = 0.6 if args.dataset == "reference" else 0.0
    if args.dataset == "reference" and args.request_rate is None:
        args.max_concurrency = max(args.max_concurrency, 256)
    rates = args.request_rate or [math.inf]
    if args.offline:
        sys.path.insert(0, REPO)
        from deltaserve import LLM, SamplingParams

        llm = LLM(args.offline, max_model_len=args.max_model_len)
        try:
            llm.generate(["warm-up"], SamplingParams(max_tokens=4), use_tqdm=False)
            results, duration = run_offline(args, llm)
        finally:
            llm.shutdown()
        summary = summarize(results, duration, math.inf)
        summary.update(model=args.offline, base_url="offline (LLM.generate)", dataset=args.dataset,
                       max_concurrency=args.max_concurrency)
        print_summary(summary)
        print(json.dumps([summary]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([summary], f, indent=2)
        return
    server = None
    if args.launch:
        server, args.base_url = launch(args)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=60).json()["data"][0][
            "id"]
        summaries = []
        for rate in rates:
            if args.warmup:
                warm = argparse.Namespace(**{**vars(args), "dataset": "random", "num_prompts": args.warmup,
                                             "input_len": 16, "output_len": 4, "range_ratio": 0.0})
                run_load(warm, model, math.inf)
            pids = server_processes(server.pid) if server is not None else {}
            cpu_before = cpu_seconds(pids)
            results, duration = run_load(args, model, rate)
            summary = summarize(results, duration, rate)
            if pids:
                used = {name: s - cpu_before[name] for name, s in cpu_seconds(pids).items()}
                summary["cpu_s_per_wall_s"] = {name: used[name] / duration for name in sorted(used)}
                http_cpu = sum(s for name, s in used.items() if name.startswith("http"))
                summary["http_cpu_us_per_output_token"] = 1e6 * http_cpu / max(1, summary["total_output_tokens"])
            summary.update(model=model, base_url=args.base_url, dataset=args.dataset, endpoint=args.endpoint,
                           max_concurrency=args.max_concurrency, client_processes=args.client_processes)
            print_summary(summary)
            if pids:  # after the run's own table, so that several rates do not read as each other's
                print("server CPU s per wall s: " + ", ".join(f"{n} {v:.2f}" for n, v in
                                                              summary["cpu_s_per_wall_s"].items()))
                print(f"HTTP server CPU per output token: {summary['http_cpu_us_per_output_token']:.1f} us")
            summaries.append(summary)
        print(json.dumps(summaries))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summaries, f, indent=2)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
