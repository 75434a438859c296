"""deltaserve's command line: one-shot generation, or serving over ZeroMQ.

    python launch.py                                  # demo: SmolLM2-135M-Instruct answers a few questions
    python launch.py --model DIR --prompt "Hi" --json # one-shot on a local Qwen3 / Llama checkpoint
    python launch.py --model DIR --serve --port 8000  # serve; then: python -m frontend.client --port 8000 "Hi"
    python launch.py --model DIR --tp 2               # tensor parallel over two devices
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from typing import Any

from common.config import ATTENTION_BACKENDS, DEVICES, DTYPES, KV_CACHE_DTYPES, ConfigError, EngineConfig
from common.protocol import GenerateRequest
from common.sampling_params import SamplingParams

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me a short introduction to large language models.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or a switch's off state (those are said in the help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="deltaserve: a multi-process LLM inference engine (frontend, scheduler and workers over ZeroMQ).",
        formatter_class=_HelpFormatter)
    g = p.add_argument_group("model and engine (vLLM names)")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder of a Qwen3 or Llama checkpoint; default: the built-in "
                        "SmolLM2-135M-Instruct demo model (downloaded and converted once)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
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
    g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
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
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off prefix caching (on by default)")
    g.add_argument("--profile-dir", default=None, help="write a cProfile trace of every process here")
    g.add_argument("--log-level", default="WARNING", help="DEBUG shows one timing line per step and process")
    s = p.add_argument_group("requests (one-shot mode)")
    s.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several)")
    s.add_argument("--max-tokens", type=int, default=64, help="most output tokens per prompt")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    s.add_argument("--chat", action="store_true", help="wrap each prompt as a user message of the chat template")
    s.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    v = p.add_argument_group("serving")
    v.add_argument("--serve", action="store_true", help="serve clients until interrupted (Ctrl-C / SIGTERM)")
    v.add_argument("--host", default="127.0.0.1", help="address the client socket binds to")
    v.add_argument("--port", type=int, default=8000, help="client socket port (1..65535)")
    v.add_argument("--transport", choices=("ipc", "tcp"), default="ipc",
                   help="between the engine's own processes: ipc sockets in a per-launch folder, or tcp")
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


def _print_worker_command(rank: int, argv: list[str]) -> None:
    print(f"deltaserve: start worker rank {rank} on its host (same model path, a checkout of deltaserve) with:\n"
          f"  {shlex.join(['python', *argv[1:]])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from frontend.launcher import EngineDeadError, EngineProcesses, EngineStartError

    demo = args.model is None and not args.prompt and not args.serve
    model = args.model
    if model is None:
        from frontend.default_model import ensure_default_model

        try:
            model = ensure_default_model()
        except ValueError as exc:  # DELTASERVE_CACHE unusable
            parser.error(str(exc))
    try:
        config = engine_config(args, model)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    prompts = args.prompt or (DEMO_PROMPTS if demo else [])
    if not args.serve and not prompts:
        parser.error("give --prompt (one or more), or --serve")
    if args.serve and args.prompt:
        parser.error("--prompt is for one-shot runs; with --serve, send prompts with python -m frontend.client")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    client_address = f"tcp://{args.host}:{args.port}" if args.serve else None
    client_listener = None
    if args.serve:  # the port is this engine's from here on: a second engine started meanwhile is refused here
        from common.ipc import hold_port

        try:
            client_listener = hold_port(args.host, args.port)
        except ValueError as exc:  # one line, not the usage: the arguments are fine, the port is taken
            parser.exit(2, f"{parser.prog}: error: {exc} (is another engine serving there? choose --port)\n")
    local_ranks = None
    if args.local_ranks is not None:
        try:
            local_ranks = [int(r) for r in args.local_ranks.split(",") if r.strip()]
        except ValueError:
            parser.error(f"--local-ranks must be comma-separated integers, got {args.local_ranks!r}")
    try:
        engine = EngineProcesses(config, client_address=client_address, transport=args.transport, host=args.host,
                                 local_ranks=local_ranks, on_external_worker=_print_worker_command,
                                 client_listener=client_listener)
    except (ConfigError, ValueError, OSError) as exc:
        parser.error(str(exc))
    # Ctrl-C and SIGTERM stop the engine, also when started from a script that ignores SIGINT.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.perf_counter()
    try:
        info = engine.start()  # a capacity warning, if any, was logged by the scheduler
        if args.serve:
            print(f"deltaserve: serving {model} on {engine.endpoints.client} "
                  f"({info['num_kv_blocks']} KV blocks of {info['block_size']} tokens); Ctrl-C to stop", flush=True)
            engine.wait()
            return 0
        print(f"deltaserve: engine ready in {time.perf_counter() - t0:.1f} s ({model})", file=sys.stderr)
        return run_prompts(engine, prompts, params, chat=args.chat or demo, as_json=args.json)
    except KeyboardInterrupt:
        print("deltaserve: stopping", file=sys.stderr)
        how = "Ctrl-C" if _stop_signal == signal.SIGINT else _stop_signal.name
        try:  # what the frontend tells its clients, rather than that it got SIGTERM
            engine.endpoints.write_stop_reason(f"the server was stopped ({how})")
        except OSError:
            pass
        return 128 + _stop_signal
    except (EngineStartError, EngineDeadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()


def run_prompts(engine: Any, prompts: list[str], params: SamplingParams, chat: bool, as_json: bool) -> int:
    from frontend.client import EngineClient

    client = EngineClient(engine.endpoints.client, liveness=engine.check)
    requests = []
    for text in prompts:
        req = GenerateRequest(client.new_request_id(), sampling=params.to_dict(), stream=False)
        if chat:
            req.messages = [{"role": "user", "content": text}]
        else:
            req.prompt = text
        requests.append(req)
    index = {r.request_id: i for i, r in enumerate(requests)}
    results: dict[int, Any] = {}
    t0 = time.perf_counter()
    client.submit(requests)
    while len(results) < len(requests):
        for out in client.recv_outputs():
            if out.finished:
                results[index[out.request_id]] = out
    elapsed = time.perf_counter() - t0
    client.close()
    status = 0
    total_tokens = 0
    for i, text in enumerate(prompts):
        out = results[i]
        total_tokens += len(out.token_ids)
        if out.error:
            status = 1
        if as_json:
            print(json.dumps({"prompt": text, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "error": out.error,
                              "num_prompt_tokens": out.num_prompt_tokens, "num_cached_tokens": out.num_cached_tokens,
                              **out.metrics}, ensure_ascii=False))
        elif out.error:
            print(f"Prompt: {text}\nError: {out.error}\n")
        else:
            ttft = out.metrics.get("ttft_s", 0.0) * 1e3
            e2e = out.metrics.get("e2e_s", 0.0)
            print(f"Prompt: {text}\nAnswer: {out.text.strip()}\n"
                  f"  [{len(out.token_ids)} tokens, finish: {out.finish_reason}, TTFT {ttft:.0f} ms, "
                  f"{len(out.token_ids) / max(e2e, 1e-9):.1f} tok/s]\n")
    if not as_json:
        print(f"{len(prompts)} prompts, {total_tokens} output tokens in {elapsed:.2f} s "
              f"({total_tokens / max(elapsed, 1e-9):.1f} output tokens/s)")
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the engine's processes exist (reading the model, fetching the demo)
        print("deltaserve: interrupted", file=sys.stderr)
        sys.exit(130)
