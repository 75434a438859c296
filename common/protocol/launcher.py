"""Start-up and shutdown: each process tells the launcher it is ready (or why it failed) on the launcher's
PULL socket (`Endpoints.control`), the scheduler and the workers agree on the KV cache over the plan and
result sockets before the first step, and the launcher (or the scheduler, to its workers) says when to exit."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from common.protocol.codec import wire_message


@wire_message
class ProcessReady:
    """Any process -> launcher: started and ready. `info` is free-form, for logs."""

    name: str  # e.g. "frontend", "scheduler", "worker-tp0"
    info: dict[str, Any] = field(default_factory=dict)


@wire_message
class ProcessFailed:
    """Any process -> launcher (and scheduler -> frontend): a fatal error, sent before exiting."""

    name: str  # the failed process, as in ProcessReady
    error: str  # human-readable cause, shown to the user


@wire_message
class WorkerReady:
    """Worker -> scheduler: model loaded; how many KV-cache blocks this rank can hold."""

    rank: int  # tensor-parallel rank, 0 .. tp_size - 1
    max_num_kv_blocks: int  # blocks that fit in this rank's KV-cache budget
    kv_bytes_per_block: int  # bytes of one block (K and V, all layers) on this rank
    device: str  # e.g. "cuda:0 (NVIDIA H200)" or "cpu"


@wire_message
class InitKVCache:
    """Scheduler -> workers: allocate this many KV-cache blocks (the minimum over ranks)."""

    num_kv_blocks: int  # blocks of `block_size` tokens, the same on every rank


@wire_message
class KVCacheReady:
    """Worker -> scheduler: cache allocated (and CUDA graphs captured)."""

    rank: int
    info: dict[str, Any] = field(default_factory=dict)  # free-form, for logs (e.g. CUDA graphs captured)


@wire_message
class EngineReady:
    """Scheduler -> frontend: the engine is serving; its capacity."""

    num_kv_blocks: int  # blocks on every rank
    block_size: int  # tokens per block
    info: dict[str, Any] = field(default_factory=dict)  # merged into EngineInfo.info (devices, step timeouts)


@wire_message
class Shutdown:
    """Launcher -> any process, or scheduler -> workers: exit cleanly."""

    reason: str = ""  # why, for logs
