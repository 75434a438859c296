"""Tensor-parallel state of a worker process: its rank, the group size and the collectives.

One worker process per device; rank r of N holds 1/N of every sharded weight. On GPUs the
collectives run over NCCL, on CPU over gloo, so the same code is tested in CI.

All-reduce on GPUs. A decode step of a 36-layer model sums 73 small activations (two a layer plus
the embedding; 2 MiB each at batch 256 and hidden 4096), so the latency of each all-reduce, not
bandwidth, is what tensor parallelism pays. For tensors up to `PEER_ALL_REDUCE_MAX_BYTES` the
worker uses a one-shot all-reduce over peer (NVLink) memory: every rank copies its tensor into a
buffer that all ranks have mapped (PyTorch symmetric memory), meets the others at a barrier, and
sums all ranks' buffers itself, in one kernel (`torch.ops.symm_mem.one_shot_all_reduce_copy`).
With two ranks that moves no more bytes than NCCL's ring and skips its protocol's steps. Larger
tensors (prefill chunks) go to NCCL. It needs no NVLink multicast (NVLS). Measured in
benchmarks/allreduce.py; DELTASERVE_ALL_REDUCE=nccl turns it off.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from common import envs

logger = logging.getLogger(__name__)

# Larger tensors go to NCCL. 8 MiB holds the decode activations of batch 512 at hidden 8192 (bf16).
PEER_ALL_REDUCE_MAX_BYTES = 8 << 20
_ALIGN = 16  # the one-shot kernel's vector width in bytes; buffer and input must share it

_rank = 0
_world_size = 1
_peer_all_reduce: PeerAllReduce | None = None


class PeerAllReduce:
    """One-shot sum over a symmetric-memory buffer of `max_bytes` that every rank maps.

    Capturable in CUDA graphs (one kernel; its barrier counters reset themselves). Every rank must
    call it with the same shapes in the same order, as for any collective.
    """

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_contiguous()
                and 0 < nbytes <= self.max_bytes and nbytes % _ALIGN == 0 and x.data_ptr() % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group (no-op for a single worker).

    `init_method` is a tcp://host:port rendezvous address. Collectives time out after 60 s, so a
    dead peer ends the process with an error instead of a hang. On CUDA the peer-memory all-reduce
    is set up too; if the devices cannot map each other's memory, NCCL does every all-reduce.
    """
    global _rank, _world_size, _peer_all_reduce
    _rank, _world_size = rank, world_size
    if world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60), **kwargs)
    if device.type == "cuda" and envs.all_reduce_impl() == "auto":
        try:
            _peer_all_reduce = PeerAllReduce(device, PEER_ALL_REDUCE_MAX_BYTES)
        except Exception as e:  # no peer access, or symmetric memory unsupported here
            logger.warning("peer-memory all-reduce unavailable (%s); NCCL does every all-reduce", e)
            _peer_all_reduce = None
        # Every rank must choose the same path, or the collectives would not match.
        ok = torch.tensor([_peer_all_reduce is not None], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            _peer_all_reduce = None
    if rank == 0:
        logger.info("tensor parallel: %d ranks over %s; all-reduce %s", world_size, backend,
                    f"one-shot peer memory up to {PEER_ALL_REDUCE_MAX_BYTES >> 20} MiB, NCCL above"
                    if _peer_all_reduce else backend)


def destroy_tensor_parallel() -> None:
    global _peer_all_reduce
    _peer_all_reduce = None
    if _world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group. Returns the sum: `x` itself (summed in place) or a new tensor."""
    if _world_size == 1:
        return x
    if _peer_all_reduce is not None and _peer_all_reduce.accepts(x):
        return _peer_all_reduce(x)
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` stacked in rank order: `[world_size, *x.shape]` on every rank."""
    if _world_size == 1:
        return x.unsqueeze(0)
    shape = x.shape
    x = x.contiguous().view(-1)
    out = torch.empty(_world_size * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x)
    return out.view(_world_size, *shape)
