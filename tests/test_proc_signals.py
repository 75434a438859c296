"""An engine process told to stop (SIGTERM) stops, wherever the signal lands."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

STOPPED_INSIDE_A_FINALIZER = """
import os, signal, time
from common.proc import setup_process

setup_process("test")


class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)  # the handler runs in here, inside __del__


obj = Finalized()
del obj
time.sleep(10)
print("still running")
"""


def test_sigterm_that_lands_in_a_finalizer_still_stops_the_process_without_a_traceback() -> None:
    # Python drops an exception raised in __del__ after printing it: the process went on as if never stopped
    # (seen as "Exception ignored in: <function Group.__del__ ...> ... SystemExit: 143" while a tokenizer loaded).
    result = subprocess.run([sys.executable, "-c", STOPPED_INSIDE_A_FINALIZER], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 128 + 15, result
    assert "still running" not in result.stdout
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_running_out_of_file_descriptors_is_not_taken_for_a_dead_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the launcher's /proc state can fail for reasons of our own (EMFILE): only a missing entry means it
    died. Before, any OSError did, and a process out of descriptors sent itself SIGTERM with no reason given."""
    import builtins
    import errno

    from common import proc

    real_open = builtins.open

    def failing_open(failure: OSError):
        def fake(path, *args, **kwargs):
            if str(path).startswith("/proc/"):
                raise failure
            return real_open(path, *args, **kwargs)
        return fake

    parent = os.getppid()
    assert not proc.parent_gone(parent)
    monkeypatch.setattr(builtins, "open", failing_open(OSError(errno.EMFILE, "Too many open files")))
    assert not proc.parent_gone(parent)
    monkeypatch.setattr(builtins, "open", failing_open(FileNotFoundError(errno.ENOENT, "gone")))
    assert proc.parent_gone(parent)
    assert proc.parent_gone(parent + 100_000)  # not our parent at all
