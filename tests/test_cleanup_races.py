"""Clean-up tolerates files that another process removed first: when an engine stops, the launcher removes the
run folder while the frontend closes its sockets, so a file may vanish between a check and its removal."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from common import ipc
from frontend.process import FrontendProcess


def vanish_after_check(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    """`os.path.exists(target)` finds the file, and another process removes it right after: the race that a
    check-then-unlink loses (once in about 25 kills of an `LLM` holding 2,048 pending requests). Only
    `target` is ever removed: every other path is looked up as usual."""
    real_exists: Callable[[str | os.PathLike], bool] = os.path.exists

    def exists_then_removed(path: str | os.PathLike) -> bool:
        found = real_exists(path)
        if found and os.fspath(path) == str(target):
            target.unlink()
        return found

    monkeypatch.setattr(os.path, "exists", exists_then_removed)


class _Closable:
    """A socket or a profiling session: close() is all the frontend's close() asks of them."""

    def close(self) -> None:
        pass


def test_the_frontend_closes_cleanly_when_its_socket_file_is_removed_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "client"
    path.touch()
    frontend = FrontendProcess.__new__(FrontendProcess)  # only what close() uses
    frontend.control = frontend.from_scheduler = frontend.to_scheduler = frontend.clients = _Closable()
    frontend.profiling = _Closable()
    frontend.client_address = f"ipc://{path}"
    vanish_after_check(monkeypatch, path)

    frontend.close()

    assert not path.exists()


def test_a_socket_binds_over_a_stale_socket_file_removed_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sock"
    path.touch()  # left by an earlier bind
    vanish_after_check(monkeypatch, path)

    ctx = zmq.Context.instance()
    pull = ipc.make_socket(ctx, zmq.PULL, f"ipc://{path}", bind=True)
    push = ipc.make_socket(ctx, zmq.PUSH, f"ipc://{path}", bind=False)
    try:
        push.send(b"bound")
        assert pull.poll(5000) and pull.recv() == b"bound"
    finally:
        push.close()
        pull.close()
