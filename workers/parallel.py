"""Tensor-parallel state of a worker process: its rank, the group size and the collectives.

One worker process per device; rank r of N holds 1/N of every sharded weight. On GPUs the
collectives run over NCCL, on CPU over gloo, so the same code is tested in CI.

All-reduce on GPUs. A decode step of a 36-layer model sums 73 small activations (two a layer plus
the embedding; 2 MiB each at batch 256 and hidden 4096), so the latency of each all-reduce, not
bandwidth, is what tensor parallelism pays. Tensors up to `PEER_ALL_REDUCE_MAX_BYTES` go through
our one-shot all-reduce over peer-mapped memory (gpu_kernels/all_reduce.py: each rank pushes its
tensor into the others' buffers over NVLink and sums what it received, one kernel, flags per
program instead of a grid-wide barrier); the buffers come from PyTorch symmetric memory, which
maps every rank's allocation into every process (no NVLink multicast needed). Larger tensors
(prefill chunks) go to NCCL. benchmarks/allreduce.py measures both; DELTASERVE_ALL_REDUCE=nccl
turns the peer path off.
"""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from common import envs
from common.errors import ExplainedError
from common.ipc import listen_on

logger = logging.getLogger(__name__)

# Larger tensors go to NCCL. 8 MiB holds the decode activations of batch 512 at hidden 8192 (bf16).
PEER_ALL_REDUCE_MAX_BYTES = 8 << 20

_rank = 0
_world_size = 1
_peer_all_reduce: PeerAllReduce | None = None


class PeerAllReduce:
    """Sum over the group with gpu_kernels/all_reduce.py, for tensors of `dtype` up to `max_bytes`.

    Capturable in CUDA graphs. Every rank must call it with the same shapes in the same order, as
    for any collective, and with one dtype (the kernel's buffer reuse relies on both).

    Raises RuntimeError at construction if the devices cannot map each other's memory or have
    too few SMs to hold all the kernel's programs at once (they all wait at once).
    """

    def __init__(self, device: torch.device, max_bytes: int, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from gpu_kernels import all_reduce as kernel

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if 2 * sms < kernel.GRID:
            raise RuntimeError(f"{sms} SMs, the kernel's {kernel.GRID} programs need at least {kernel.GRID // 2}")
        if _world_size > kernel.MAX_WORLD_SIZE:
            raise RuntimeError(f"{_world_size} ranks, the kernel takes at most {kernel.MAX_WORLD_SIZE}")
        self.kernel, self.max_bytes, self.dtype = kernel, max_bytes, dtype
        nbytes = kernel.buffer_bytes(_world_size, max_bytes)
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.buffer.zero_()  # flags start at epoch 0
        handle = symm_mem.rendezvous(self.buffer, dist.group.WORLD.group_name)
        self._views = [handle.get_buffer(r, [nbytes], torch.uint8, 0) for r in range(_world_size)]
        self.bases = torch.tensor([v.data_ptr() for v in self._views], dtype=torch.int64, device=device)
        self.epochs = torch.zeros(kernel.GRID, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()  # no rank pushes before every rank has zeroed its flags

    def accepts(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.one_shot_all_reduce(x, torch.empty_like(x), self.buffer, self.bases, self.epochs,
                                               _rank, _world_size, self.max_bytes)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel.one_shot_all_reduce_add_rms_norm(x, residual, weight, eps, torch.empty_like(x),
                                                            self.buffer, self.bases, self.epochs, _rank,
                                                            _world_size, self.max_bytes)


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device,
                         dtype: torch.dtype = torch.bfloat16, listen_fd: int = -1) -> None:
    """Join the tensor-parallel group (no-op for a single worker).

    `init_method` is the tcp://host:port rendezvous address; rank 0 serves it (a `TCPStore`) on that
    host only, through `listen_fd` when the launcher handed it the listening socket (held since the
    address was chosen, so no other process can take the port), else on a socket it binds there
    itself. (torch's own tcp:// rendezvous would listen on every interface.) Collectives time out after
    60 s, so a dead peer ends the process with an error instead of a hang. On CUDA the peer-memory
    all-reduce is set up too, for tensors of `dtype` (the model's); if the devices cannot map each
    other's memory, NCCL does every all-reduce.
    """
    global _rank, _world_size, _peer_all_reduce
    _rank, _world_size = rank, world_size
    if world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = timedelta(seconds=60)
    store = rendezvous_store(init_method, rank, world_size, timeout, listen_fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    if device.type == "cuda" and envs.all_reduce_impl() == "auto":
        try:
            _peer_all_reduce = PeerAllReduce(device, PEER_ALL_REDUCE_MAX_BYTES, dtype)
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


def rendezvous_store(address: str, rank: int, world_size: int, timeout: timedelta, listen_fd: int = -1) -> dist.Store:
    """The torch.distributed store at tcp://host:port `address`: served by rank 0 on `host` alone (through the
    listening socket `listen_fd` if >= 0), a client of it elsewhere. Raises `ValueError` for an address that
    is not tcp://host:port or a host rank 0 cannot listen on."""
    url = urlparse(address)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"the rendezvous address must be tcp://host:port, got {address!r}")
    if rank != 0:
        return dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=timeout)
    listener = None
    if listen_fd < 0:
        listener = listen_on(url.hostname, url.port)
        listen_fd = listener.detach()  # the store owns the socket from here on
    return dist.TCPStore(url.hostname, url.port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listen_fd)


def destroy_tensor_parallel() -> None:
    global _peer_all_reduce
    _peer_all_reduce = None
    if _world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def peer_loss_explained() -> Iterator[None]:
    """Turn the error a torch.distributed collective raises when another rank has gone (gloo: "Connection
    reset by peer"; NCCL: a `DistBackendError`) into an `ExplainedError` of one line, so that the survivors
    report a consequence, not a traceback; the launcher names the rank that died. Other errors pass."""
    try:
        yield
    except RuntimeError as exc:
        if _world_size == 1 or not _raised_by_torch_distributed(exc):
            raise
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        detail = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]).split(". This is typically")[0]  # drop gloo's source path
        raise ExplainedError(f"a collective with the other tensor-parallel ranks failed, most likely because "
                             f"one of them has died ({detail})") from None


def _raised_by_torch_distributed(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    return any("/torch/distributed/" in frame.filename.replace("\\", "/")
               for frame in traceback.extract_tb(exc.__traceback__))


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


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sum of `x` over the group plus `residual`, RMS-normalised, in one kernel (CUDA, peer path):
    returns (normed, new residual), `residual` updated in place; or None where that kernel does not
    apply (a single rank, NCCL only, or a tensor too large), and the caller runs the steps apart.

    x, residual `[T, hidden]` in the model dtype; weight `[hidden]`. Every rank makes the same
    choice, since it depends only on shapes, dtypes and the group's shared set-up.
    """
    peer = _peer_all_reduce
    if (_world_size == 1 or peer is None or not peer.accepts(x) or not residual.is_contiguous()
            or residual.dtype != x.dtype or x.shape[-1] > peer.kernel.MAX_NORM_HIDDEN):
        return None
    return peer.add_rms_norm(x, residual, weight, eps)


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` stacked in rank order: `[world_size, *x.shape]` on every rank."""
    if _world_size == 1:
        return x.unsqueeze(0)
    shape = x.shape
    x = x.contiguous().view(-1)
    out = torch.empty(_world_size * x.numel(), dtype=x.dtype, device=x.device)
    # all_gather_single replaces all_gather_into_tensor (deprecated, warns) in newer torch releases
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x)
    return out.view(_world_size, *shape)
