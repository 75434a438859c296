"""benchmarks/step_logs.py: a benchmark keeps the step-log folder it was given and removes the one it made, also
when it is stopped (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.step_logs import VARIABLE, step_log_folder
from tests.conftest import REPO


def test_a_given_folder_is_used_absolute_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(VARIABLE, "logs")
    with step_log_folder() as folder:
        assert folder == str(tmp_path / "logs")
    assert os.environ[VARIABLE] == "logs"


@pytest.mark.parametrize("given", [None, "", "   "])
def test_without_a_folder_a_temporary_one_is_made_set_and_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   given: str | None) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if given is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, given)
    with step_log_folder("bench-steps-") as folder:
        assert Path(folder).parent == tmp_path and Path(folder).name.startswith("bench-steps-")
        assert os.environ[VARIABLE] == folder
        (Path(folder) / "worker-tp0.jsonl").write_text("{}\n")
    assert not os.path.exists(folder)
    assert os.environ.get(VARIABLE) == given


STOPPED = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from benchmarks.step_logs import run_main, step_log_folder

def main():
    with step_log_folder() as folder:
        print(folder, flush=True)
        {stop}
        time.sleep(30)

run_main(main)
"""


@pytest.mark.parametrize("stop, status", [("os.kill(os.getpid(), signal.SIGTERM)", 143),
                                          ("raise KeyboardInterrupt", 130)])
def test_a_stopped_benchmark_removes_its_folder_and_exits_without_a_traceback(tmp_path: Path, stop: str,
                                                                               status: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE} | {"TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", STOPPED.format(repo=str(REPO), stop=stop)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip().startswith(str(tmp_path)) and not list(tmp_path.iterdir())
