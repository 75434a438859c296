"""What a peer on the network can reach: the internal tcp sockets admit only the engine's own processes
(CURVE, with keys drawn per launch), the client port only those with its key when `--client-key` is set,
ports are held from the moment they are chosen, and the torch.distributed rendezvous listens on the
engine's host alone."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common import curve, ipc
from common.config import EngineConfig
from common.protocol import (
    AbortSeqs,
    AddRequests,
    EngineRequest,
    GenerateRequest,
    Ping,
    ProcessFailed,
    Shutdown,
    StepResult,
    Submit,
    encode,
    i32,
)
from deltaserve import EngineClient, SamplingParams
from frontend.launcher import EngineProcesses
from tests.test_engine_vs_hf import ID_PROMPTS, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# What an attacker sends: garbage, and forged messages that would each stop the engine, abort or forge requests.
FORGED = [b"\xc1\xc1 garbage", encode(Shutdown("forged")), encode(ProcessFailed("worker-tp0", "forged")),
          encode(AbortSeqs(list(range(64)))), encode(StepResult(0, i32([1]))), encode(Ping()),
          encode(AddRequests([EngineRequest(10**6, i32([1, 2, 3]), 0.0, 4, None, [], 0.0)])),
          encode(Submit([GenerateRequest("forged", prompt="hi")]))]


@pytest.fixture(scope="module")
def tcp_engine(tiny_qwen3: Path):
    """Two local ranks over tcp: every kind of internal socket (plans of each rank, the rendezvous)."""
    config = EngineConfig(model=str(tiny_qwen3), device="cpu", block_size=16, max_model_len=256,
                          tensor_parallel_size=2)
    engine = EngineProcesses(config, transport="tcp")
    engine.start()
    yield engine
    t0 = time.monotonic()
    engine.shutdown()  # the ZAP threads do not hold a process up
    assert time.monotonic() - t0 < 8
    assert all(p.returncode != -9 for p in engine.procs.values()), {n: p.returncode for n, p in engine.procs.items()}


def internal_addresses(e: ipc.Endpoints) -> list[str]:
    return [e.client, e.control, e.frontend_in, e.scheduler_in, e.worker_out, *e.plans]


def _served_correctly(engine: EngineProcesses, model: Path) -> bool:
    client = EngineClient(engine.endpoints.client, liveness=engine.check, curve=engine.client_keys())
    try:
        out = list(client.generate(ID_PROMPTS[1], GREEDY, stream=False))[-1]
    finally:
        client.close()
    return out.token_ids == hf_greedy(str(model), tuple(ID_PROMPTS[1]))[:16]


def _attack(addresses: list[str], keys: curve.CurveKeys | None, wait_s: float = 3.0) -> dict[str, list[int]]:
    """Connect a DEALER, a PUSH and a PULL socket with `keys` (None: plain) to every address, send each
    forged message from those that can send, and return, per "address kind", the handshake events seen
    and (as -1) each message a PULL received."""
    ctx = zmq.Context.instance()
    socks = []
    for address in addresses:
        for kind in (zmq.DEALER, zmq.PUSH, zmq.PULL):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED)
            if keys is not None:
                keys.apply(sock, address, bind=False)
            sock.connect(address)
            socks.append((f"{address} {sock.type}", sock, monitor))
    for _, sock, _ in socks:
        if sock.type != zmq.PULL:
            for data in FORGED:
                try:
                    sock.send(data, zmq.NOBLOCK)
                except zmq.Again:
                    pass
    time.sleep(wait_s)
    seen: dict[str, list[int]] = {}
    for name, sock, monitor in socks:
        events = seen.setdefault(name, [])
        while monitor.poll(0):
            events.append(recv_monitor_message(monitor)["event"])
        while sock.type == zmq.PULL and sock.poll(0):
            sock.recv()
            events.append(-1)
        sock.disable_monitor()
        monitor.close()
        sock.close()
    return seen


def test_peers_without_the_engines_keys_are_refused_by_every_internal_socket(tcp_engine: EngineProcesses,
                                                                             tiny_qwen3: Path) -> None:
    """A plain peer and a CURVE peer with a key of its own (it may know the server's public key): neither
    completes a handshake, so none of the forged messages arrives and no step plan leaks; the engine serves."""
    e = tcp_engine.endpoints
    addresses = internal_addresses(e)
    assert all(a.startswith("tcp://") for a in addresses)
    # The kind of socket the engine itself connects to each address (another kind fails even earlier).
    matching = {e.client: zmq.DEALER, **{a: zmq.PUSH for a in (e.control, e.frontend_in, e.scheduler_in,
                                                                 e.worker_out)}, **{a: zmq.PULL for a in e.plans}}
    impostor = curve.client_keys(tcp_engine.keys["frontend"].server_public)
    failed = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
    for keys in (None, impostor):
        seen = _attack(addresses, keys)
        succeeded = [name for name, events in seen.items() if zmq.EVENT_HANDSHAKE_SUCCEEDED in events]
        leaked = [name for name, events in seen.items() if -1 in events]
        assert not succeeded and not leaked, (succeeded, leaked)
        assert all(failed & set(events) for events in seen.values()), seen
        if keys is not None:  # the authenticator itself said no, on every socket
            refused = {a: seen[f"{a} {kind}"] for a, kind in matching.items()}
            assert all(zmq.EVENT_HANDSHAKE_FAILED_AUTH in events for events in refused.values()), refused
    tcp_engine.check()
    assert _served_correctly(tcp_engine, tiny_qwen3)


def test_an_engine_process_may_connect_only_where_it_sends_or_receives(tcp_engine: EngineProcesses,
                                                                       tiny_qwen3: Path) -> None:
    """Least privilege: a worker's keys (those printed for another host) cannot reach the frontend's or the
    scheduler's request sockets, nor another rank's plans, so a compromised worker host cannot abort or
    forge requests."""
    e = tcp_engine.endpoints
    worker = tcp_engine.keys["worker-tp1"]
    seen = _attack([e.client, e.frontend_in, e.scheduler_in, e.plans[0]], worker)
    refused = [seen[f"{e.client} {zmq.DEALER}"], seen[f"{e.frontend_in} {zmq.PUSH}"],
               seen[f"{e.scheduler_in} {zmq.PUSH}"], seen[f"{e.plans[0]} {zmq.PULL}"]]
    assert all(zmq.EVENT_HANDSHAKE_FAILED_AUTH in events for events in refused), refused
    assert not any(zmq.EVENT_HANDSHAKE_SUCCEEDED in events or -1 in events for events in seen.values()), seen
    assert tcp_engine.keys["worker-tp1"].servers == {}  # it binds nothing: it never holds the server's secret key
    tcp_engine.check()
    assert _served_correctly(tcp_engine, tiny_qwen3)


def test_the_rendezvous_listens_on_the_engine_host_only(tcp_engine: EngineProcesses) -> None:
    port = int(tcp_engine.endpoints.dist_init.rsplit(":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}


def test_secret_keys_stay_off_the_command_lines(tcp_engine: EngineProcesses) -> None:
    secrets = {k.secret for k in tcp_engine.keys.values()} | {s.secret for k in tcp_engine.keys.values()
                                                               for s in k.servers.values()}
    for proc in tcp_engine.procs.values():
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert not any(secret in cmdline for secret in secrets)


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))  # /proc prints host-order words
                found.add(socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, words))
    return found


def test_every_tcp_port_is_held_from_the_moment_it_is_chosen() -> None:
    """A port probed and let go before the real bind was taken in between about one start in twenty
    ("Address already in use"): it stays listening in the launcher until the process that binds it inherits it."""
    endpoints = ipc.Endpoints.create(2, "tcp")
    try:
        addresses = internal_addresses(endpoints) + [endpoints.dist_init]
        assert set(endpoints.listen_fds) == set(addresses)
        for address in addresses:
            with socket.socket() as s, pytest.raises(OSError):
                s.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
        assert endpoints.fds_of("scheduler") == tuple(endpoints.listen_fds[a] for a in
                                                      [endpoints.scheduler_in, endpoints.worker_out, *endpoints.plans])
    finally:
        endpoints.release_ports()
        endpoints.cleanup()
    assert listening_addresses(int(endpoints.control.rsplit(":", 1)[1])) == set()


def test_the_printed_worker_command_carries_its_keys_in_its_environment(capsys) -> None:
    import shlex

    import launch

    keys = curve.CurveKeys(*curve.new_key_pair(), curve.new_key_pair()[0])
    launch._print_worker_command(1, ["/usr/bin/python3", "-m", "workers", "--rank", "1"],
                                 {curve.ENV_VAR: keys.to_json()})
    out, err = capsys.readouterr()
    line = err.splitlines()[1]  # with every other status line, on stderr
    assert out == ""
    words = shlex.split(line)
    assert words[0] == f"{curve.ENV_VAR}={keys.to_json()}" and words[1:] == ["python", "-m", "workers", "--rank", "1"]
    assert curve.CurveKeys.from_json(words[0].split("=", 1)[1]) == keys


@pytest.mark.parametrize("allow_listed", [False, True])
def test_a_client_port_served_with_a_key_answers_only_clients_that_have_it(tiny_qwen3: Path, tmp_path: Path,
                                                                         allow_listed: bool) -> None:
    import zmq.auth

    server_pub, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    (tmp_path / "clients").mkdir()
    client_pub, client_secret = zmq.auth.create_certificates(tmp_path / "clients", "alice")
    public, secret = curve.load_key_file(server_secret, secret=True)
    allowed = curve.load_allowed_keys(str(tmp_path / "clients")) if allow_listed else None
    address = f"tcp://127.0.0.1:{ipc.free_port()}"
    config = EngineConfig(model=str(tiny_qwen3), device="cpu", block_size=16, max_model_len=256)
    engine = EngineProcesses(config, client_address=address, client_curve=curve.CurveServer(public, secret, allowed))
    try:
        engine.start()
        alice = curve.load_key_file(client_secret, secret=True)
        good = EngineClient(address, curve=curve.client_keys(public, alice))  # type: ignore[arg-type]
        assert good.engine_info(timeout_s=20).block_size == 16
        good.close()
        for keys in ([None] + ([curve.client_keys(public)] if allow_listed else [])):
            stranger = EngineClient(address, curve=keys, dead_after_s=2)
            with pytest.raises(Exception, match="no answer from the engine"):
                stranger.engine_info(timeout_s=3)
            stranger.close()
            # Once the server has refused the handshake the client's socket has no peer, and a send (a ping
            # every 0.2 s here) would block for good: every wait still ends in its time, naming the cause.
            stranger = EngineClient(address, curve=keys, dead_after_s=2, ping_interval_s=0.2)
            errors: list[BaseException] = []

            def ask(client: EngineClient = stranger, errors: list[BaseException] = errors) -> None:
                for _ in range(3):
                    try:
                        client.engine_info(timeout_s=2)
                    except Exception as exc:  # noqa: BLE001 - collected for the assertion below
                        errors.append(exc)

            asker = threading.Thread(target=ask, daemon=True)
            asker.start()
            asker.join(30)
            assert not asker.is_alive(), "a client without the server's keys waited past its timeouts"
            assert len(errors) == 3 and all(re.search("no answer from the engine|cannot reach the engine at", str(e))
                                            for e in errors), errors
            stranger.close()
        engine.check()
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("argv", "message"), [
    (["--serve", "--client-key", "/nonexistent/server.key_secret"], "cannot read the CURVE key file"),
    (["--prompt", "hi", "--client-key", "k.key_secret"], "--client-key is for --serve"),
    (["--serve", "--client-allowed-keys", "clients"], "--client-allowed-keys needs --client-key"),
])
def test_client_key_options_that_cannot_be_used_are_refused_by_name(tiny_qwen3: Path, argv: list[str],
                                                                     message: str, capsys) -> None:
    import launch

    port = [] if "--prompt" in argv else ["--port", str(ipc.free_port())]  # --port serves: not with --prompt
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--model", str(tiny_qwen3), *port, *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_public_key_file_is_refused_where_a_secret_one_is_needed(tmp_path: Path, capsys) -> None:
    import zmq.auth

    from frontend.client_cli import main

    public, _ = zmq.auth.create_certificates(tmp_path, "alice")
    with pytest.raises(ValueError, match="has no secret key"):
        curve.load_key_file(public, secret=True)
    with pytest.raises(SystemExit):
        main(["--server-key", public, "--client-key", public, "hi"])
    assert "has no secret key (give the .key_secret file)" in capsys.readouterr().err
