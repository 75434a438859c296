"""Where a benchmark's engine writes its per-step timing logs, and running a benchmark's main until Ctrl-C.

Every engine process appends one JSON line per step to `$DELTASERVE_STEP_LOG_DIR/<process>.jsonl` (docs/profiling.md,
"Timing without a profile"); the benchmarks read the worker's lines for device time and idle time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator

from common import envs

VARIABLE = "DELTASERVE_STEP_LOG_DIR"


@contextlib.contextmanager
def step_log_folder(prefix: str = "deltaserve-steps-") -> Iterator[str]:
    """Yield the absolute folder the engine started inside this block writes its step logs to.

    With `DELTASERVE_STEP_LOG_DIR` set (not blank) that folder, kept for later analysis. Otherwise a new temporary
    folder named `prefix*`, set as the variable for the block and removed when it ends, also when the run ends on
    Ctrl-C or SIGTERM (turned into `SystemExit(143)` inside the block, so that clean-up runs).
    """
    given = os.environ.get(VARIABLE)
    kept = envs.step_log_dir()  # the engine's own reading of the variable: absolute, made if missing
    if kept is not None:
        yield kept
        return
    folder = tempfile.mkdtemp(prefix=prefix)
    os.environ[VARIABLE] = folder
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield folder
    finally:
        signal.signal(signal.SIGTERM, previous)
        if given is not None:
            os.environ[VARIABLE] = given
        else:
            del os.environ[VARIABLE]
        shutil.rmtree(folder, ignore_errors=True)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_main(main: Callable[[], int | None]) -> None:
    """Run a benchmark's `main` and exit with its status; Ctrl-C exits with 130 and one line, no traceback."""
    try:
        status = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(status or 0)
