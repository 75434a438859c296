"""The engine's ipc socket folder: its socket addresses must fit a Unix socket address wherever $TMPDIR is."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import zmq

from common import ipc


@pytest.mark.parametrize("tp_size", [1, 3])
def test_a_deep_temporary_folder_moves_the_sockets_to_tmp_and_every_address_binds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp_size: int) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    endpoints = ipc.Endpoints.create(tp_size)
    ctx = zmq.Context()
    try:
        assert os.path.dirname(endpoints.run_dir) == "/tmp"
        assert os.stat(endpoints.run_dir).st_mode & 0o777 == 0o700
        addresses = [endpoints.client, endpoints.control, endpoints.frontend_in, endpoints.scheduler_in,
                     endpoints.worker_out, *endpoints.plans]
        assert len(endpoints.plans) == tp_size and not list(deep.iterdir())  # nothing left in the deep folder
        for address in addresses:
            sock = ctx.socket(zmq.PULL)
            sock.bind(address)  # ZMQError "ipc path ... is longer than 107 characters" before
            sock.close(linger=0)
    finally:
        ctx.term()
        endpoints.cleanup()
    assert not os.path.exists(endpoints.run_dir)


def test_a_short_temporary_folder_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    short = tempfile.mkdtemp(prefix="t-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", short)
    try:
        run_dir = ipc.run_folder("scheduler_in")
        assert os.path.dirname(run_dir) == short
    finally:
        shutil.rmtree(short)
