"""Every environment variable deltaserve reads, in one place."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """DELTASERVE_CACHE: where the demo model and downloaded test assets are kept (~/.cache/deltaserve)."""
    return os.environ.get("DELTASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deltaserve")


def check_invariants() -> bool:
    """DELTASERVE_CHECK_INVARIANTS=1: the scheduler asserts its block-accounting invariants after every
    step (slow; for tests). A violation kills the engine with the failed assertion as the message."""
    return os.environ.get("DELTASERVE_CHECK_INVARIANTS", "") == "1"


def step_log_dir() -> str | None:
    """DELTASERVE_STEP_LOG_DIR: every process appends one JSON line of timing per step to
    `<dir>/<process name>.jsonl` (scheduler: planning; workers: input preparation, device time,
    device idle time before the step)."""
    return os.environ.get("DELTASERVE_STEP_LOG_DIR") or None


def client_silence_s() -> float:
    """DELTASERVE_CLIENT_SILENCE_S: seconds after which a client that sends nothing (waiting clients
    ping every 2 s) counts as gone and its requests are aborted (default 60)."""
    return float(os.environ.get("DELTASERVE_CLIENT_SILENCE_S", "60"))


def all_reduce_impl() -> str:
    """DELTASERVE_ALL_REDUCE: `auto` (default: one-shot peer-memory all-reduce for small tensors on
    GPUs, NCCL otherwise) or `nccl` (NCCL for every all-reduce; for comparison)."""
    value = os.environ.get("DELTASERVE_ALL_REDUCE", "auto")
    if value not in ("auto", "nccl"):
        raise ValueError(f"DELTASERVE_ALL_REDUCE must be 'auto' or 'nccl', got {value!r}")
    return value


def step_timeout_s() -> float:
    """DELTASERVE_STEP_TIMEOUT_S: seconds a step may stay unfinished before the scheduler declares a
    worker stuck (a stopped process, a hung GPU, a peer lost inside a collective) and shuts the
    engine down with that message (default 300; 0 turns the watchdog off)."""
    raw = os.environ.get("DELTASERVE_STEP_TIMEOUT_S", "300")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also refuses NaN, which would silently turn the watchdog off
        raise ValueError(f"DELTASERVE_STEP_TIMEOUT_S must be a number >= 0, got {raw!r}")
    return value
