"""Compile kernels for Hopper (sm90) on a machine without a GPU: a script run in a child process without
TRITON_INTERPRET (which this folder's conftest sets for the tests), so that `triton.compile` builds real PTX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_compile_script(script: str, timeout_s: float = 300) -> dict:
    """Run `script` (Python that compiles kernels and prints one JSON object as its last line) in a child process
    without the interpreter, with the repository on its path and FP fusion on as on a GPU; returns that object.
    Fails the test with the child's stderr if it exits non-zero."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
