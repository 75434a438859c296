"""deltaserve's command line: one-shot generation, or serving over ZeroMQ and HTTP.

Status lines (the serving banner, "engine ready", errors, the profile summary) go to stderr, as vLLM logs; stdout
carries only the answers of a one-shot run.

    python launch.py                                  # demo: SmolLM2-135M-Instruct answers a few questions
    python launch.py --model DIR --prompt "Hi" --json # one-shot on a local Qwen3 / Llama checkpoint
    python launch.py --model DIR --serve --port 8000  # serve; then: python -m frontend.client --port 8000 "Hi"
    python launch.py --model DIR --serve --http-port 8000   # the OpenAI API on http://127.0.0.1:8000/v1
    python launch.py --model DIR --tp 2               # tensor parallel over two devices
"""

from __future__ import annotations

import signal
import sys

_sigint_during_imports = False


def _note_sigint(signum: int, frame: object) -> None:
    global _sigint_during_imports
    _sigint_during_imports = True
    raise KeyboardInterrupt


def _interrupted(exc: BaseException | None) -> bool:
    """Whether `exc` is a Ctrl-C, or an error raised because of one: Python wraps an exception raised while a class
    body is set up (`__set_name__`, a dataclass field) in a RuntimeError whose cause is the KeyboardInterrupt."""
    for _ in range(8):
        if exc is None or isinstance(exc, KeyboardInterrupt):
            return exc is not None
        exc = exc.__cause__
    return False


# A Ctrl-C while these load (numpy, transformers' config: ~1 s) exits as one after start-up does: 130, quietly; the
# handler notes it, since a module being set up may turn the KeyboardInterrupt into another error.
_default_sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
if _default_sigint:
    signal.signal(signal.SIGINT, _note_sigint)
try:
    import argparse
    import os
    import shlex
    import time
    from typing import Any

    from common.config import (
        ATTENTION_BACKENDS,
        DEFAULT_MAX_MESSAGE_BYTES,
        DEFAULT_PROFILE_STEPS,
        DEVICES,
        DTYPES,
        KV_CACHE_DTYPES,
        MAX_STEPS_IN_FLIGHT,
        REASONING_PARSERS,
        STRUCTURED_OUTPUTS_BACKENDS,
        ConfigError,
        EngineConfig,
    )
    from common.protocol import GenerateRequest
    from common.sampling_params import SEED_LIMIT, SamplingParams
    from common.units import count
    from frontend.cli import ArgumentParser, HelpFormatter
    from frontend.tool_parsers import TOOL_PARSER_NAMES
except BaseException as exc:
    if _sigint_during_imports or _interrupted(exc):
        sys.exit(130)
    raise
if _default_sigint:
    signal.signal(signal.SIGINT, signal.default_int_handler)

PROGRESS_REFRESH_S = 0.2  # the one-shot progress bar shows the output tokens so far this often (seconds)
DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me a short introduction to large language models.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        description="deltaserve: a multi-process LLM inference engine (frontend, scheduler and workers over ZeroMQ).",
        formatter_class=HelpFormatter)
    g = p.add_argument_group("model and engine (vLLM names)")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder of a Qwen3, Llama or Mistral (without a sliding window) checkpoint; "
                        "default: the built-in SmolLM2-135M-Instruct demo model (downloaded and converted once)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API: requests may ask for any, responses carry the first "
                        "(default: the model folder's name)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens per request, prompt + output (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one step; longer prompts are prefilled in chunks")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kvcache-blocks", type=int, default=None, help="force the KV cache to this many blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="fixed KV-cache size in GiB (overrides --gpu-memory-utilization; CPU default 1)")
    g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs nor torch.compile")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, help="decode batch sizes to capture")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and activations: auto = the checkpoint's 16-bit dtype on GPU, float32 on CPU")
    g.add_argument("--device", choices=DEVICES, default="auto", help="auto = cuda when available")
    g.add_argument("--seed", type=int, default=0, help="random seed of the workers")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1,
                   help="worker processes (one per device) to split the model over")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto = triton on GPU (faster than FlashAttention-4 on an H200), torch on CPU")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto = the model's dtype; fp8 = float8 e4m3 with a scale per layer for K and for V "
                        "(half the bytes of bf16; triton or torch attention backend)")
    g.add_argument("--structured-outputs-backend", choices=STRUCTURED_OUTPUTS_BACKENDS, default="auto",
                   help="auto = llguidance for JSON schemas and JSON objects, xgrammar for regex, choice and EBNF; "
                        "xgrammar = xgrammar for all")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split chat outputs into reasoning (<think>...</think>, the API's reasoning_content) and "
                        "answer; a structured-output constraint then applies to the answer (vLLM's names)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a request's logits are bitwise the same whatever else is in its "
                        "batch, so greedy and seeded requests (--sampling-seed) repeat exactly (CPU or GPU; "
                        "docs/deterministic.md)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off prefix caching (on by default)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="most requests accepted but not started (no output token yet); one more is refused at once "
                        "as 'overloaded' (default: unlimited; set it when serving)")
    g.add_argument("--max-steps-in-flight", type=int, default=2, choices=range(1, MAX_STEPS_IN_FLIGHT + 1),
                   metavar="K", help="steps planned ahead of the workers' results (1-4, default 2: step N+1 is "
                                     "planned while N runs); 3 gives the host's round trip two device steps, for "
                                     "steps shorter than it (small batches)")
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest client message (bytes, at least 65536); a client sending more is disconnected "
                        "before it is read")
    g.add_argument("--profile-dir", default=None,
                   help="profile every process: a torch.profiler trace per process (CUDA activity on GPU workers), "
                        "one merged timeline (DIR/timeline.json.gz), a summary (DIR/summary.txt, also printed at "
                        "the end) and a cProfile file per process")
    g.add_argument("--profile-steps", default=DEFAULT_PROFILE_STEPS, metavar="A:B",
                   help="with --profile-dir: the steps traced by themselves, A..B-1 (a bounded window: a trace keeps "
                        "every event in memory until it stops); 'none': only while a client asks "
                        "(python -m frontend.client --start-profile / --stop-profile)")
    g.add_argument("--log-level", default="WARNING", help="DEBUG shows one timing line per step and process")
    s = p.add_argument_group("requests (one-shot mode)")
    s.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several)")
    s.add_argument("--max-tokens", type=int, default=64, help="most output tokens per prompt")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    s.add_argument("--sampling-seed", type=int, default=None, metavar="SEED",
                   help="each prompt's own sampling seed (SamplingParams.seed): a sampled prompt then gives the same "
                        "tokens in every run, and with --deterministic also among any other prompts; without it its "
                        "seed comes from --seed and the order the prompts arrive in")
    from frontend.cli import add_sampling_arguments
    from frontend.launcher import TIMEOUT_HEADER_S, TIMEOUT_KEEP_ALIVE_S

    add_sampling_arguments(s)
    s.add_argument("--chat", action="store_true", help="wrap each prompt as a user message of the chat template")
    s.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    v = p.add_argument_group("serving")
    v.add_argument("--serve", action="store_true", help="serve clients until interrupted (Ctrl-C / SIGTERM)")
    v.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP server and the ZeroMQ client socket bind to (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=None, metavar="PORT",
                   help="ZeroMQ client socket port (python -m frontend.client, EngineClient), not HTTP: that is "
                        "--http-port; 1..65535; implies --serve; default 8000, or none with --http-port (the HTTP "
                        "server then reaches the engine inside this host)")
    v.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help="the OpenAI-compatible HTTP API's port (vLLM's --port); implies --serve")
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: $DELTASERVE_API_KEY, "
                        "else no key)")
    v.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP server processes sharing --http-port (more only if one cannot keep up)")
    v.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None,
                   help="with --http-port: how tool_choice 'auto' reads tool calls out of an output: hermes "
                        "(<tool_call>{...}</tool_call>: Qwen3, Hermes) or llama3_json (Llama 3.1+)")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="with --tool-call-parser: allow tool_choice 'auto' (the default when a request has tools)")
    v.add_argument("--timeout-keep-alive", type=int, default=None, metavar="SECONDS",
                   help=f"seconds an idle HTTP keep-alive connection stays open (default {TIMEOUT_KEEP_ALIVE_S}: "
                        "longer than the pool expiry of common clients, 5 s for httpx and openai, so that none reuses "
                        "a connection just as the server closes it)")
    v.add_argument("--timeout-header", type=float, default=None, metavar="SECONDS",
                   help=f"seconds an HTTP connection may take to send a request head, from its accept (or, on a "
                        f"keep-alive connection, from the first byte of its next request), and between two reads of a "
                        f"body; then it is answered 408 and closed (default {TIMEOUT_HEADER_S:g})")
    v.add_argument("--transport", choices=("ipc", "tcp"), default="ipc",
                   help="between the engine's own processes: ipc sockets in a per-launch folder, or tcp")
    v.add_argument("--client-key", default=None,
                   help="serve the client port with CURVE encryption under this key pair (a .key_secret file made "
                        "by zmq.auth.create_certificates); clients need its public key (python -m frontend.client "
                        "--server-key FILE.key)")
    v.add_argument("--client-allowed-keys", default=None,
                   help="with --client-key: a folder of clients' public key files (*.key); only those clients may "
                        "connect (default: any client that has the server's public key)")
    v.add_argument("--local-ranks", default=None,
                   help="comma-separated worker ranks to start here (default: all); the others are started by hand "
                        "on other hosts with the printed command (needs --transport tcp and a reachable --host)")
    return p


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    fields = set(EngineConfig.field_names()) - {"model"}
    kwargs: dict[str, Any] = {k: v for k, v in vars(args).items() if k in fields}
    return EngineConfig(model=model, **kwargs)


_stop_signal = signal.SIGINT  # what stopped the engine: the exit status is 128 + its number (130, 143)


def _interrupt(signum: int, frame: object) -> None:
    # Once: the first Ctrl-C or SIGTERM stops the engine, and a repeated one must not interrupt that
    # (during EngineProcesses.shutdown it only hurries the stop along).
    global _stop_signal
    _stop_signal = signal.Signals(signum)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _print_worker_command(rank: int, argv: list[str], env: dict[str, str]) -> None:
    assigns = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
    print(f"deltaserve: start worker rank {rank} on its host (same model path, a checkout of deltaserve) with the "
          f"command below; it holds this launch's secret keys, so pass it over a trusted channel:\n"
          f"  {assigns} {shlex.join(['python', *argv[1:]])}", file=sys.stderr, flush=True)


def check_arguments(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one line, what the arguments alone show to be wrong, before any model is read or process
    started: prompts that are not UTF-8 text, a port out of range, a host with no network address."""
    from frontend.cli import undecodable_text, unresolvable_host

    for n, text in enumerate(args.prompt or [], 1):
        where = undecodable_text(text)
        if where is not None:
            parser.error(f"--prompt {n} is not UTF-8 text: {where} cannot be decoded: give prompts in UTF-8")
    for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
        if port is not None and not 0 < port < 65536:
            parser.error(f"{flag} must be in 1..65535, got {port}")
    if args.port is not None and args.port == args.http_port:
        parser.error(f"--port and --http-port are both {args.port}: give them different ports")
    if not 1 <= args.api_server_count <= 64:
        parser.error(f"--api-server-count must be in 1..64, got {args.api_server_count}")
    if args.api_server_count > 1 and args.http_port is None:
        parser.error("--api-server-count needs --http-port")
    if args.timeout_keep_alive is not None:
        if args.http_port is None:
            parser.error("--timeout-keep-alive needs --http-port")
        if args.timeout_keep_alive < 1:
            parser.error(f"--timeout-keep-alive must be at least 1 (seconds), got {args.timeout_keep_alive}")
    if args.timeout_header is not None:
        from frontend.launcher import timeout_header_error

        if args.http_port is None:
            parser.error("--timeout-header needs --http-port")
        error = timeout_header_error(args.timeout_header)
        if error is not None:
            parser.error(f"--timeout-header {error}")
    if args.tool_call_parser is not None and args.http_port is None:
        parser.error("--tool-call-parser needs --http-port: it reads tool calls for the HTTP server")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser NAME: tool_choice 'auto' reads the calls "
                     f"the model writes with it ({', '.join(TOOL_PARSER_NAMES)})")
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key must not be empty")
    if args.client_key is not None and args.http_port is not None:
        parser.error("--client-key secures the ZeroMQ client port, which the HTTP server (--http-port) connects "
                     "to itself: use one or the other (the HTTP server takes --api-key)")
    unresolved = unresolvable_host(f"tcp://{args.host}:1")  # the engine's own sockets use it too
    if unresolved is not None:
        parser.error(f"cannot resolve --host {unresolved[0]!r}: {unresolved[1]}")


def refuse_prompt_when_serving(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse `--prompt` beside a flag that serves (`--serve`, `--port`, `--http-port`), in one line that says how to
    send the prompt to the server instead: over HTTP when it serves HTTP, else with the ZeroMQ client."""
    if args.http_port is not None:
        base = f"http://{args.host}:{args.http_port}/v1"
        zmq = f", or with python -m frontend.client --port {args.port}" if args.port is not None else ""
        parser.error(f"--prompt is for one-shot runs, and --http-port serves: start the server without --prompt, "
                     f"then send prompts to {base}/completions or /v1/chat/completions (curl, or the openai client "
                     f"with base_url='{base}'){zmq}")
    if args.serve or args.port is not None:
        flag = "--port serves ZeroMQ clients" if args.port is not None else "--serve starts a server"
        parser.error(f"--prompt is for one-shot runs, and {flag}: start the server without --prompt, then send "
                     f"prompts with python -m frontend.client --port {args.port or 8000} (or EngineClient), or serve "
                     "HTTP too with --http-port and send them to /v1/completions (curl, or the openai client)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    from common.ipc import AddressInUseError
    from frontend.launcher import EngineDeadError, EngineProcesses, EngineStartError, HTTPOptions

    if args.prompt:
        refuse_prompt_when_serving(parser, args)
    args.serve = args.serve or args.port is not None or args.http_port is not None
    if args.serve and args.json:
        parser.error("--json prints the answers of a one-shot run (--prompt); a server sends its answers to its "
                     "clients: drop --json, or run python -m frontend.client --json against the server")
    demo = args.model is None and not args.prompt and not args.serve
    if not args.serve and not args.prompt and not demo:
        parser.error("give --prompt (one or more), or --serve")
    from frontend.cli import sampling_params_from_args

    if args.sampling_seed is not None and not 0 <= args.sampling_seed < SEED_LIMIT:  # its own flag in the message
        parser.error(f"--sampling-seed must be an integer in [0, 2**63), got {args.sampling_seed}")
    params = sampling_params_from_args(parser, args, temperature=args.temperature, max_tokens=args.max_tokens,
                                       ignore_eos=args.ignore_eos, seed=args.sampling_seed)
    if params.n > args.max_num_seqs >= 1:  # the engine's own check, made before it starts (its samples run at once)
        parser.error(f"--n must be at most --max-num-seqs ({args.max_num_seqs}): the samples of a prompt run at "
                     f"once, got {params.n}")
    local_ranks = None
    if args.local_ranks is not None:
        try:
            local_ranks = [int(r) for r in args.local_ranks.split(",") if r.strip()]
        except ValueError:
            parser.error(f"--local-ranks must be comma-separated integers, got {args.local_ranks!r}")
    client_curve = None
    if args.client_allowed_keys is not None and args.client_key is None:
        parser.error("--client-allowed-keys needs --client-key")
    if args.client_key is not None:
        if not args.serve:
            parser.error("--client-key is for --serve")
        from common.curve import CurveServer, load_allowed_keys, load_key_file

        try:
            public, secret = load_key_file(args.client_key, secret=True)
            allowed = None if args.client_allowed_keys is None else load_allowed_keys(args.client_allowed_keys)
        except ValueError as exc:
            parser.error(str(exc))
        client_curve = CurveServer(public, secret or "", allowed)
    model = args.model
    if model is None:
        from frontend.default_model import ensure_default_model

        try:
            model = ensure_default_model()
        except ValueError as exc:  # DELTASERVE_CACHE unusable
            parser.error(str(exc))
    try:
        config = engine_config(args, model)
    except ConfigError as exc:
        parser.option_error(str(exc))
    prompts = args.prompt or DEMO_PROMPTS
    # Serving: ZeroMQ clients on --port (8000 unless only --http-port is given), HTTP on --http-port.
    zmq_port = args.port if args.port is not None or args.http_port is not None else 8000
    client_address = f"tcp://{args.host}:{zmq_port}" if args.serve and zmq_port is not None else None
    client_listener = http = None
    if args.serve:  # the ports are this engine's from here on: a second engine started meanwhile is refused here
        from common.ipc import hold_port

        held: dict[str, Any] = {}
        for flag, port in (("--port", zmq_port), ("--http-port", args.http_port)):
            if port is None:
                continue
            try:
                held[flag] = hold_port(args.host, port)
            except ValueError as exc:
                for sock in held.values():
                    sock.close()
                in_use = isinstance(exc, AddressInUseError)
                hint = f" (is another engine serving there? choose {flag})" if in_use else ""
                parser.exit(2, f"{parser.prog}: error: {exc}{hint}\n")  # one line: the arguments are fine
        client_listener = held.get("--port")
        if "--http-port" in held:
            timeouts = {name: value for name, value in (("timeout_keep_alive_s", args.timeout_keep_alive),
                                                        ("timeout_header_s", args.timeout_header)) if value is not None}
            http = HTTPOptions(args.host, args.http_port, held["--http-port"], args.api_key, args.api_server_count,
                               **timeouts, tool_call_parser=args.tool_call_parser,
                               enable_auto_tool_choice=args.enable_auto_tool_choice)
    try:
        engine = EngineProcesses(config, client_address=client_address, transport=args.transport, host=args.host,
                                 local_ranks=local_ranks, on_external_worker=_print_worker_command,
                                 client_listener=client_listener, client_curve=client_curve, http=http)
    except (ConfigError, ValueError, OSError) as exc:
        parser.option_error(str(exc))
    # Ctrl-C and SIGTERM stop the engine, also when started from a script that ignores SIGINT.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.perf_counter()
    try:
        info = engine.start()  # a capacity warning, if any, was logged by the scheduler
        mode = "; deterministic mode" if info.get("deterministic") else ""
        if args.serve:
            where = [f"the OpenAI API on http://{args.host}:{args.http_port}/v1"] if http is not None else []
            if client_address is not None:
                where.append(f"ZeroMQ clients on {engine.endpoints.client}")
            print(f"deltaserve: serving {info['model']} ({config.model}) to {' and '.join(where)} "
                  f"({count(info['num_kv_blocks'], 'KV block')} of {count(info['block_size'], 'token')}{mode}); "
                  "Ctrl-C to stop", file=sys.stderr, flush=True)
            engine.wait()
            return 0
        print(f"deltaserve: engine ready in {time.perf_counter() - t0:.1f} s ({config.model}{mode})", file=sys.stderr)
        return run_prompts(engine, prompts, params, chat=args.chat or demo, as_json=args.json)
    except KeyboardInterrupt:
        print("deltaserve: stopping", file=sys.stderr)
        how = "Ctrl-C" if _stop_signal == signal.SIGINT else _stop_signal.name
        what = "the server was stopped" if args.serve else "the run was interrupted"
        try:  # what the frontend tells its clients (and logs), rather than that it got SIGTERM
            engine.endpoints.write_stop_reason(f"{what} ({how})")
        except OSError:
            pass
        return 128 + _stop_signal
    except (EngineStartError, EngineDeadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()


def decode_rate(num_tokens: int, ttft_s: float, e2e_s: float, num_samples: int = 1) -> float | None:
    """Output tokens per second after the first token: (tokens - samples) / (time from the first token to
    the last), `num_tokens` counted over the request's `num_samples` samples (each has its first token at
    the TTFT); None without a decode phase to time (one token a sample)."""
    if num_tokens <= num_samples or e2e_s <= ttft_s:
        return None
    return (num_tokens - num_samples) / (e2e_s - ttft_s)


def run_prompts(engine: Any, prompts: list[str], params: SamplingParams, chat: bool, as_json: bool,
                progress: bool | None = None) -> int:
    """Run every prompt to its end, then print the answers in prompt order (`as_json`: one JSON object per
    line on stdout, every sample in `outputs`); returns 1 if any prompt failed, else 0.

    While they run, a progress bar on stderr counts finished prompts and the output tokens streamed so far
    (`progress` None: only when stderr is a terminal). On `KeyboardInterrupt` (Ctrl-C, or SIGTERM through
    `_interrupt`) it prints what every prompt has so far, the unfinished ones marked as interrupted, and
    re-raises. Raises `EngineDeadError` if an engine process dies.
    """
    from tqdm.auto import tqdm

    from frontend.client import EngineClient, StreamedOutput

    client = EngineClient(engine.endpoints.client, liveness=engine.check)
    requests = []
    for text in prompts:
        req = GenerateRequest(client.new_request_id(), sampling=params.to_dict(), stream=True)
        if chat:
            req.messages = [{"role": "user", "content": text}]
        else:
            req.prompt = text
        requests.append(req)
    index = {r.request_id: i for i, r in enumerate(requests)}
    answers = [StreamedOutput(r.request_id) for r in requests]
    bar = tqdm(total=len(prompts), desc="Generating", unit="prompt", file=sys.stderr, dynamic_ncols=True,
               disable=None if progress is None else not progress)
    num_finished = num_output_tokens = 0
    t0 = last_shown = time.perf_counter()
    try:
        client.submit(requests)
        while num_finished < len(requests):
            for out in client.recv_outputs():
                answer = answers[index[out.request_id]]
                answer.add(out)
                num_output_tokens += sum(len(s.token_ids) for s in out.outputs)
                if out.finished:
                    num_finished += 1
                    bar.update(1)
            now = time.perf_counter()
            bar.set_postfix_str(f"{count(num_output_tokens, 'output token')}, "
                                f"{num_output_tokens / max(now - t0, 1e-9):.1f} tok/s", refresh=False)
            if now - last_shown >= PROGRESS_REFRESH_S:  # tokens stream in long before the first prompt finishes
                bar.refresh()
                last_shown = now
    except KeyboardInterrupt:
        bar.close()
        print_answers(prompts, answers, as_json, time.perf_counter() - t0)
        raise
    finally:
        bar.close()
        client.close()
    return print_answers(prompts, answers, as_json, time.perf_counter() - t0)


def print_answers(prompts: list[str], answers: list[Any], as_json: bool, elapsed: float) -> int:
    """Print each prompt's answer (`StreamedOutput`s; an unfinished one as interrupted, with the text it has);
    returns 1 if any prompt failed or was interrupted, else 0."""
    from frontend.client_cli import json_line, json_row

    status = 0
    for text, answer in zip(prompts, answers):
        out = answer.output()
        error = out.error if answer.finished else "interrupted before it finished"
        status |= error is not None
        n = answer.num_tokens
        samples = out.outputs
        rate = decode_rate(n, out.metrics.get("ttft_s", 0.0), out.metrics.get("e2e_s", 0.0), len(samples))
        if as_json:
            row = json_row(text, out)
            if not answer.finished:
                row["finish_reason"], row["error"] = "abort", error
            row["decode_tokens_per_s"] = rate
            print(json_line(row))
        elif not answer.finished:
            print(f"Prompt: {text}\nAnswer (interrupted after {count(n, 'token')}): {out.text.strip()}\n")
        elif error:
            print(f"Prompt: {text}\nError: {error}\n")
        else:
            timing = f"TTFT {out.metrics.get('ttft_s', 0.0) * 1e3:.0f} ms"
            if rate is not None:
                timing += f", decode {rate:.1f} tok/s"
            texts = "".join(f"Answer{f' {s.index}' if len(samples) > 1 else ''}: {s.text.strip()}\n" for s in samples)
            print(f"Prompt: {text}\n{texts}  [{count(n, 'token')}, finish: {out.finish_reason}, {timing}]\n")
    if not as_json:
        total = sum(a.num_tokens for a in answers)
        print(f"{count(len(prompts), 'prompt')}, {count(total, 'output token')} in {elapsed:.2f} s "
              f"({total / max(elapsed, 1e-9):.1f} output tokens/s)", flush=True)
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the engine's processes exist (reading the model, fetching the demo)
        print("deltaserve: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # stdout's reader left (`| head`); the engine was shut down on the way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush cannot fail
        sys.exit(141)  # 128 + SIGPIPE, as a shell tool that a closed pipe ends
