"""Attack a served engine as a hostile client and a hostile peer would, and print what each attempt got.

    python benchmarks/attack.py --model DIR [--transport tcp] [--max-waiting-requests 1000]

Starts `launch.py --serve` on CPU, then, checking after each round that a normal request still gets the same
greedy tokens:
1. 2,000 malformed messages at the client port (random bytes, msgpack of any shape, every message type name
   with random fields, 1 MiB fields, several frames);
2. one frame of 200 MB;
3. a burst of 10,000 requests in one submission (and with --max-waiting-requests, how many are refused);
4. with --transport tcp: a DEALER, a PUSH and a PULL socket without the engine's keys at every other port
   the engine's processes listen on (found as a port scan would), sending garbage, Shutdown, ProcessFailed
   and AbortSeqs;
5. SIGKILL of each engine process in turn (a fresh server each time), timing until every process is gone.
Addresses are on this machine only (127.0.0.1).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.ipc import free_port  # noqa: E402
from common.protocol import (  # noqa: E402
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    AbortSeqs,
    GenerateRequest,
    ProcessFailed,
    Shutdown,
    decode,
    encode,
)
from frontend.client import EngineClient  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [1000, 2000, 3000, 4000]


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports these processes listen on, as a port scan of this host would find them."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def serve(args: argparse.Namespace, port: int) -> tuple[subprocess.Popen, dict[str, int]]:
    cmd = [sys.executable, "launch.py", "--model", args.model, "--serve", "--port", str(port), "--device", "cpu",
           "--max-model-len", "256", "--transport", args.transport, "--log-level", "ERROR"]
    if args.max_waiting_requests:
        cmd += ["--max-waiting-requests", str(args.max_waiting_requests)]
    server = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    for line in server.stderr:  # launch.py's status lines, the serving banner among them
        print(line, end="", file=sys.stderr)
        if line.startswith("deltaserve: serving "):
            break
    else:
        raise SystemExit(f"the server exited with code {server.wait()} before serving")
    threading.Thread(target=lambda: sys.stderr.writelines(server.stderr), daemon=True).start()
    children = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f, open(f"/proc/{pid}/cmdline") as g:
                    status, title = f.read(), g.read().split("\0")[0]
            except OSError:
                continue
            if f"PPid:\t{server.pid}\n" in status:
                children[title.split("deltaserve-", 1)[-1]] = int(pid)  # "deltaserve-frontend", set by setproctitle
    return server, children


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) >> 10


def greedy(port: int) -> list[int]:
    from common.sampling_params import SamplingParams

    client = EngineClient(f"tcp://127.0.0.1:{port}", dead_after_s=30)
    try:
        return list(client.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                    stream=False))[-1].token_ids
    finally:
        client.close()


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-10**6, 10**6)])
    if kind == 2:
        return rng.random() * 10**rng.randrange(-3, 30)
    if kind == 3:
        return "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(20)))
    if kind == 4:
        return rng.randbytes(rng.randrange(20))
    if kind == 5:
        return rng.choice([True, False, "x" * (1 << 20)])
    if kind in (6, 7):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {str(random_value(rng, depth + 1)): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def malformed(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randbytes(rng.randrange(200))]
    if kind == 1:
        return [msgpack.packb(random_value(rng))]
    if kind == 2:
        name = rng.choice(sorted(MESSAGE_TYPES))
        return [msgpack.packb([PROTOCOL_VERSION, name, *[random_value(rng) for _ in range(rng.randrange(8))]])]
    if kind == 3:
        reqs = [[random_value(rng) if rng.random() < 0.3 else f"r{i}", rng.choice([None, "hi", random_value(rng)]),
                 rng.choice([None, [5, 6], random_value(rng)]), None, {"max_tokens": random_value(rng)}, False]
                for i in range(rng.randrange(4))]
        return [msgpack.packb([PROTOCOL_VERSION, "Submit", reqs, random_value(rng)])]
    return [rng.randbytes(8) for _ in range(rng.randrange(2, 5))]


def drain(sock: zmq.Socket, wait_ms: int) -> list[object]:
    out = []
    while sock.poll(wait_ms):
        out.append(decode(sock.recv()))
        wait_ms = 0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--transport", choices=("ipc", "tcp"), default="tcp")
    p.add_argument("--max-waiting-requests", type=int, default=1000)
    args = p.parse_args()
    ctx = zmq.Context.instance()
    port = free_port()
    server, children = serve(args, port)
    try:
        reference = greedy(port)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        rng = random.Random(0)
        t0 = time.monotonic()
        replies, longest = 0, 0
        for _ in range(2000):
            sock.send_multipart(malformed(rng))
            for reply in drain(sock, 5):
                replies += 1
                longest = max(longest, len(encode(reply)))
        replies += len(drain(sock, 2000))
        print(f"1. 2000 malformed messages in {time.monotonic() - t0:.1f} s: {replies} replies, the largest "
              f"{longest} bytes; still exact: {greedy(port) == reference}", flush=True)
        before = rss_mib(children["frontend"])
        sock.send(b"\x00" * 200_000_000)
        answered = bool(drain(sock, 3000))
        after = rss_mib(children["frontend"])
        print(f"2. a 200 MB frame: answered {answered}; the frontend held {before} MiB before, {after} MiB after; "
              f"still exact: {greedy(port) == reference}", flush=True)
        sock.close()
        client = EngineClient(f"tcp://127.0.0.1:{port}", dead_after_s=60)
        t0 = time.monotonic()
        burst = [GenerateRequest(client.new_request_id(), prompt_token_ids=[1000 + i % 5000, 7, 8],
                                 sampling={"max_tokens": 1}) for i in range(10_000)]
        client.submit(burst)
        finished, refused = 0, 0
        while finished < len(burst):
            for out in client.recv_outputs(timeout_s=120):
                finished += out.finished
                refused += bool(out.error and "overloaded" in out.error)
        client.close()
        print(f"3. 10,000 requests in one submission: done in {time.monotonic() - t0:.1f} s, {refused} refused as "
              f"overloaded (--max-waiting-requests {args.max_waiting_requests}); still exact: "
              f"{greedy(port) == reference}", flush=True)
        if args.transport == "tcp":
            ports = listening_ports([server.pid, *children.values()]) - {port}
            addresses = [f"tcp://127.0.0.1:{p}" for p in sorted(ports)]
            socks, leaked = [], 0
            for address in addresses:
                for kind in (zmq.DEALER, zmq.PUSH, zmq.PULL):
                    s = ctx.socket(kind)
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(address)
                    socks.append(s)
                    if kind != zmq.PULL:
                        for data in (b"garbage", encode(Shutdown("x")), encode(ProcessFailed("scheduler", "x")),
                                     encode(AbortSeqs(list(range(100_000))))):
                            try:
                                s.send(data, zmq.NOBLOCK)
                            except zmq.Again:
                                pass
            time.sleep(3)
            for s in socks:
                while s.type == zmq.PULL and s.poll(0):
                    s.recv()
                    leaked += 1
                s.close()
            print(f"4. foreign DEALER/PUSH/PULL at {len(addresses)} internal ports: {leaked} messages received; "
                  f"server alive: {server.poll() is None}; still exact: {greedy(port) == reference}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    for victim in ("frontend", "scheduler", "worker-tp0", "launcher"):
        port = free_port()
        server, children = serve(args, port)
        pids = list(children.values())
        os.kill(server.pid if victim == "launcher" else children[victim], signal.SIGKILL)
        t0 = time.monotonic()
        while any(os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read()
                  for pid in pids) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        if victim != "launcher":
            server.wait(timeout=30)
        print(f"5. SIGKILL of {victim}: every engine process gone in {time.monotonic() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
