"""The command-line client of a running engine (`python -m frontend.client` runs `main`), and the `--json`
row that it and launch.py's one-shot mode print per prompt.

    python -m frontend.client --port 8000 "What is the capital of France?"
    python -m frontend.client --port 8000 --start-profile     # then --stop-profile (engine run with --profile-dir)
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from common.config import MAX_PROFILE_STEPS
from common.curve import CurveKeys, client_keys, load_key_file
from common.protocol import GenerateRequest, RequestOutput
from frontend.cli import (
    ArgumentParser,
    HelpFormatter,
    add_sampling_arguments,
    sampling_params_from_args,
    undecodable_text,
    unresolvable_host,
)
from frontend.client import EngineClient, EngineConnectionError, output_dict

# The metrics every `--json` line carries, null where a request has none (one refused before it ran).
JSON_METRICS = ("ttft_s", "e2e_s", "num_preemptions", "queue_s")


def json_row(prompt: str, out: RequestOutput) -> dict[str, Any]:
    """One line of `--json` output (client and launch.py): the prompt, `output_dict` with the metrics
    flattened in; every key of `JSON_METRICS` is present, None where `out` lacks it, so that a failed
    prompt's line has the same keys as a finished one's."""
    row = {"prompt": prompt, **output_dict(out)}
    metrics = row.pop("metrics")
    row.update({key: None for key in JSON_METRICS}, **metrics)
    return row


def json_line(row: dict[str, Any]) -> str:
    """`row` (a `json_row`) as one JSON line. A logprob entry's `token_bytes` (a token that holds part of a UTF-8
    character) is written as a list of byte values, as the HTTP API's `bytes` field is."""
    return json.dumps(row, ensure_ascii=False, default=_json_value)


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _curve_options(server_key: str | None, client_key: str | None) -> CurveKeys | None:
    """The CLI's CURVE keys: `server_key` a public key file or Z85 text, `client_key` a secret key file.
    Raises `ValueError` naming the option for one that cannot be used."""
    if server_key is None:
        if client_key is not None:
            raise ValueError("--client-key needs --server-key (the server's public key)")
        return None
    public = server_key if len(server_key) == 40 and not os.path.exists(server_key) else None
    try:
        if public is None:
            public = load_key_file(server_key, secret=False)[0]
        own = None
        if client_key is not None:
            own_public, own_secret = load_key_file(client_key, secret=True)
            own = (own_public, own_secret or "")
        return client_keys(public, own)
    except ValueError as exc:
        raise ValueError(f"--server-key / --client-key: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m frontend.client", formatter_class=HelpFormatter,
                       description="Submit prompts to a running deltaserve engine and print the answers.")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--prompt", action="append", default=[], dest="prompt_options", metavar="TEXT",
                   help="a prompt, as launch.py takes them (repeatable; after the positional prompts)")
    p.add_argument("--host", default="127.0.0.1", help="host of the engine (launch.py --serve --host)")
    p.add_argument("--port", type=int, default=8000, help="port of the engine (launch.py --serve --port), 1..65535")
    p.add_argument("--address", default=None, help="full ZMQ address (tcp://... or ipc://...), overrides host/port")
    p.add_argument("--max-tokens", type=int, default=64, help="most output tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None,
                   help="seed in [0, 2**63) that makes each prompt's samples reproducible (default: the engine's "
                        "own seeded stream)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    add_sampling_arguments(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message of the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt when it finishes (a failed one with its error)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds without any answer before giving up (> 0)")
    p.add_argument("--start-profile", nargs="?", type=int, const=0, default=None, metavar="STEPS",
                   help="start tracing every engine process at the next step, for at most STEPS steps (default: as "
                        "many as the engine's --profile-steps window holds); the engine needs --profile-dir")
    p.add_argument("--stop-profile", action="store_true",
                   help="stop the trace after the last step planned so far, wait until its files are written and "
                        "merged, and print the summary")
    p.add_argument("--server-key", default=None,
                   help="the server's CURVE public key (its .key file, or the 40-character key), for a server "
                        "started with --client-key")
    p.add_argument("--client-key", default=None,
                   help="this client's CURVE key pair (a .key_secret file), for a server that admits only listed "
                        "clients (--client-allowed-keys); default: a fresh pair")
    args = p.parse_args(argv)
    args.prompts += args.prompt_options
    profiling = args.start_profile is not None or args.stop_profile
    if profiling and (args.prompts or (args.start_profile is not None and args.stop_profile)):
        p.error("--start-profile and --stop-profile are used alone (no prompts, not both at once)")
    if not profiling and not args.prompts:
        p.error("give one or more prompts, or --start-profile / --stop-profile")
    if args.start_profile is not None and not 0 <= args.start_profile <= MAX_PROFILE_STEPS:
        p.error(f"--start-profile STEPS must be in [0, {MAX_PROFILE_STEPS}] (0: the engine's window length), "
                f"got {args.start_profile}")
    if not args.timeout > 0:  # also refuses NaN
        p.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    params = sampling_params_from_args(p, args, temperature=args.temperature, max_tokens=args.max_tokens,
                                       seed=args.seed, ignore_eos=args.ignore_eos)
    for n, text in enumerate(args.prompts, 1):
        where = undecodable_text(text)
        if where is not None:
            p.error(f"prompt argument {n} is not UTF-8 text: {where} cannot be decoded: give prompts in UTF-8")
    if args.address is None and not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    address = args.address or f"tcp://{args.host}:{args.port}"
    try:
        curve = _curve_options(args.server_key, args.client_key)
        client = EngineClient(address, dead_after_s=args.timeout, curve=curve)
    except ValueError as exc:
        p.error(str(exc))
    unresolved = unresolvable_host(address)
    if unresolved is not None:
        client.close()
        host, why = unresolved
        print(f"error: cannot resolve the engine host {host!r} ({'--address' if args.address else '--host'}): {why}",
              file=sys.stderr)
        return 1
    try:
        client.engine_info(timeout_s=args.timeout)
    except EngineConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if profiling:
        return profile_command(client, args.start_profile, args.json)
    stream = len(args.prompts) == 1 and not args.json and params.n == 1
    reqs: list[GenerateRequest] = []
    for text in args.prompts:
        req = GenerateRequest(client.new_request_id(), sampling=params.to_dict(), stream=stream)
        if args.chat:
            req.messages = [{"role": "user", "content": text}]
        else:
            req.prompt = text
        reqs.append(req)
    order = {r.request_id: i for i, r in enumerate(reqs)}
    results: dict[str, dict[str, Any]] = {}
    finished: list[RequestOutput | None] = [None] * len(reqs)
    printed = 0  # answers are printed in the prompts' order, each once every earlier one is (as launch.py does)
    client.submit(reqs)
    status = 0
    try:
        while len(results) < len(reqs):
            for out in client.recv_outputs():
                if stream:
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                if not out.finished:
                    continue
                results[out.request_id] = json_row(args.prompts[order[out.request_id]], out)
                finished[order[out.request_id]] = out
                if out.error:
                    if stream:  # end the line of the text streamed so far
                        print()
                    print(f"error: {out.error}", file=sys.stderr)
                    status = 1
                while printed < len(reqs) and (done := finished[printed]) is not None:
                    printed += 1
                    if args.json:  # every prompt, failed ones too: one object per prompt
                        print(json_line(results[done.request_id]))
                    elif not stream and not done.error:
                        for sample in done.outputs:
                            label = f" [sample {sample.index}]" if params.n > 1 else ""
                            print(f"--- {results[done.request_id]['prompt']}{label}\n{sample.text}\n")
        if stream and not status:
            print()
    except KeyboardInterrupt:
        client.abort([r.request_id for r in reqs])
        return 130
    except EngineConnectionError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return status


def profile_command(client: EngineClient, start_steps: int | None, as_json: bool) -> int:
    """--start-profile (`start_steps` not None) or --stop-profile: ask, print the answer, close the client."""
    try:
        if start_steps is not None:
            status = client.start_profile(start_steps)
            text = (f"profiling session {status.session}: steps {status.first_step}..{status.last_step} at most "
                    f"(stop it with --stop-profile); files go to {status.folder}")
        else:
            status = client.stop_profile()
            text = status.summary or (f"profiling session {status.session} stopped after step {status.last_step}; "
                                      f"files in {status.folder}")
    except (RuntimeError, EngineConnectionError) as exc:  # the engine refused, or did not answer
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if as_json:
        print(json.dumps({"session": status.session, "first_step": status.first_step, "last_step": status.last_step,
                          "folder": status.folder, "summary": status.summary}, ensure_ascii=False))
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0
