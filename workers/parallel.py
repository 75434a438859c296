"""Tensor-parallel state of a worker process: its rank, the group size and the collectives.

One worker process per device; rank r of N holds 1/N of every sharded weight. On GPUs the
collectives run over NCCL, on CPU over gloo, so the same code is tested in CI.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_rank = 0
_world_size = 1


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group (no-op for a single worker).

    `init_method` is a tcp://host:port rendezvous address. Collectives time out after 60 s, so a
    dead peer ends the process with an error instead of a hang.
    """
    global _rank, _world_size
    _rank, _world_size = rank, world_size
    if world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60), **kwargs)


def destroy_tensor_parallel() -> None:
    if _world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group, in place; returns it."""
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's `x` along `dim` on rank 0; other ranks get None."""
    if _world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world_size)] if _rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place."""
    if _world_size > 1:
        dist.broadcast(x, src=0)
    return x
