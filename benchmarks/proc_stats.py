"""CPU time of the engine's processes, read from /proc (Linux), for the benchmarks.

A process that blocks on its sockets when it has nothing to do uses a small fraction of a core; one
that polls in a loop uses a whole core however idle it is. `cpu_seconds` reads utime + stime of
`/proc/<pid>/stat` (fields 14 and 15, in clock ticks); `EngineCPU` samples every process of an `LLM`
before and after a run.
"""

from __future__ import annotations

import os
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds used so far by process `pid` (its threads included). Raises
    `OSError` if the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat(5)


class EngineCPU:
    """CPU seconds each process of `llm` (a `deltaserve.LLM`) used between `start()` and `stop()`."""

    def __init__(self, llm: Any) -> None:
        self.pids = {name: p.pid for name, p in llm.engine.procs.items()}
        self.before: dict[str, float] = {}

    def start(self) -> None:
        self.before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) - self.before[name] for name, pid in self.pids.items()}


def format_cpu(used: dict[str, float], wall_s: float) -> str:
    """"scheduler 0.12 s (0.02 per wall s), ..." for every process."""
    return ", ".join(f"{name} {s:.2f} s ({s / wall_s:.2f} per wall s)" for name, s in sorted(used.items()))
