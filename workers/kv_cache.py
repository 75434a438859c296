"""The paged KV cache: its size (`num_kv_blocks`), its one tensor (`allocate_kv_cache`), copy-on-write of a
block (`copy_fork_blocks`), and its element type (below).

The cache is one tensor `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]` (keys, values), of which
each attention layer holds its `k_cache` and `v_cache` slices. On a GPU its size is what is left of
`gpu_memory_utilization` of the card after the weights, the peak activations of a warm-up step at the largest
batch (the model runner measures it) and the memory outside torch; on a CPU, `kv_cache_memory_gb` (1 GiB by
default), refused beyond the host's available memory.

The element type: the model's dtype, or fp8 (float8 e4m3fn) with one scale per layer
for the keys and one for the values (`kv_cache_dtype="fp8"`, vLLM's name; "auto" is the model's dtype).

An fp8 element holds `e4m3(x / scale)`, 1 byte instead of 2 (bf16) or 4 (fp32), so the same memory
holds twice (four times) the tokens and a decode step reads half the bytes of KV cache. e4m3 keeps
3 mantissa bits (a relative rounding error of at most 2^-4, against bf16's 2^-8) over normal values
from 2^-6 to 448 times the scale. See `gpu_kernels/fp8.py` for the rounding.

How the scales are chosen. Before the cache exists, each worker runs one prefill of a calibration
batch (`CALIBRATION_SEQS` sequences of `CALIBRATION_LEN` token ids drawn uniformly from the
vocabulary, a fixed seed) with a temporary cache in the model's dtype, and reads, per layer, the
largest |key| and |value| stored. The scale is that maximum times `SCALE_HEADROOM`, over 448,
rounded up to a power of two; it is then fixed for the engine's life (captured CUDA graphs bake it
in). Under tensor parallelism the ranks take the maximum over all of them, so every rank uses the
scales a single device would. Why so:
- Per-tensor, not 1.0: vLLM's uncalibrated default of 1.0 assumes keys and values of order one. A
  layer whose values are all near 0.01 would then sit in e4m3's subnormal range (below 2^-6, with
  fewer than 3 mantissa bits), and one whose keys exceed 448 would saturate. Calibration puts each
  layer's largest values near the top of the range whatever the model.
- Headroom: a prompt may produce larger keys or values than random tokens do (positions beyond
  the calibration length rotate keys further; real text has outlier tokens). Values beyond
  448 x scale saturate, which is a real error, while the headroom costs only its log2 in binades at
  the bottom of the range, of the 15 binades of normal e4m3 numbers: values up to
  `SCALE_HEADROOM` (to twice that, after the rounding) times the calibration maximum are stored
  unsaturated, and values down to 2^-15 of the calibration maximum keep all 3 mantissa bits.
- Powers of two: `x / scale` and `code * scale` are then exact in float32, so the only rounding is
  e4m3's own, and the fused store kernel, the plain one and the torch path store the same bytes.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.errors import ExplainedError
from common.units import count, format_bytes
from workers.attention.base import AttentionMetadata
from workers.host_buffers import to_device

if TYPE_CHECKING:
    from common.config import EngineConfig
    from workers.request_state import ReqState

log = logging.getLogger("deltaserve.worker")
GiB = 1 << 30


def kv_bytes_per_block(attn_layers: list, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of the cache: the keys and values of `block_size` tokens in every layer."""
    layer = attn_layers[0]
    per_token = 2 * len(attn_layers) * layer.num_kv_heads * layer.head_dim * dtype.itemsize
    return per_token * block_size


def allocate_kv_cache(attn_layers: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """One zeroed tensor `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]` of `dtype`, bound to
    `attn_layers`: layer i's `k_cache` and `v_cache` are its slices `[0, i]` and `[1, i]`.

    On a CPU the tensor lies in an anonymous memory map, which the kernel hands out zeroed page by page as it is
    first written: the host commits memory only for the blocks requests use, and start-up does not write the
    whole budget (a default 1 GiB cache took 0.9 s of CPU to zero with `torch.zeros`)."""
    layer = attn_layers[0]
    shape = (2, len(attn_layers), num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
    if torch.device(device).type == "cpu":
        kv_cache = zeroed_host_tensor(shape, dtype)
    else:
        kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    for i, attn in enumerate(attn_layers):
        attn.k_cache = kv_cache[0, i]
        attn.v_cache = kv_cache[1, i]
    return kv_cache


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in its own anonymous `mmap` (zero-filled by the kernel on first touch, so pages never
    written cost no memory and no time). The tensor keeps the map alive; it is unmapped when the last view of the
    tensor goes."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def release_kv_cache(attn_layers: list) -> None:
    """Unbind the layers from their cache (empty tensors), so that the cache's memory can be freed."""
    for attn in attn_layers:
        attn.k_cache = attn.v_cache = torch.empty(0)


def copy_fork_blocks(kv_cache: torch.Tensor | None, block_table: np.ndarray, forks: list[tuple[ReqState, ReqState]],
                     block_size: int, device: torch.device) -> None:
    """Copy-on-write of n > 1: each fork's copy of its parent's last, partial prompt block gets that
    block's KV (all layers), which the forward just wrote. Full prompt blocks are shared, not copied.
    `block_table`: the batch's `[max_num_seqs, max_blocks]` int32 table; `forks`: (fork, parent) states."""
    bs = block_size
    src, dst = [], []
    table = block_table
    for fork, parent in forks:
        n = parent.num_prompt_tokens
        if n % bs:
            src.append(int(table[parent.row, n // bs]))
            dst.append(int(table[fork.row, n // bs]))
    if src and kv_cache is not None:
        s, d = to_device(np.array(src, np.int64), device), to_device(np.array(dst, np.int64), device)
        kv_cache[:, :, d] = kv_cache[:, :, s]


def prefill_batch(lens: list[int], block_size: int, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions `[T]` int64 (T = sum of `lens`) and prefill metadata of fresh sequences of `lens` tokens, for the
    passes before the cache exists (the fp8 calibration, the memory profile): sequence i in blocks
    `i * width .. (i + 1) * width - 1`, width the blocks of the longest, `len(lens) * width` blocks in all."""
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    bs = block_size
    width = -(-max(lens) // bs)
    tables = (np.arange(len(lens))[:, None] * width + np.arange(width)[None, :]).astype(np.int32)
    seq_index = np.repeat(np.arange(len(lens)), lens)
    slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
    dev = device
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc=torch.from_numpy(qsl).to(dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=torch.from_numpy(tables).to(dev),
        max_query_len=max(lens), max_seq_len=max(lens), is_decode=False,
        query_start_loc_cpu=qsl, seq_lens_cpu=np.array(lens, dtype=np.int32))
    return torch.from_numpy(positions).to(dev), meta


def host_memory_available() -> int | None:
    """Bytes of host memory available to new allocations (MemAvailable of /proc/meminfo), or None
    where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# The most KV blocks a memory budget is turned into (a forced `num_kvcache_blocks` is taken as given), unless the
# running sequences could fill more at once (max_num_seqs x blocks of max_model_len). Blocks past what the running
# sequences hold only keep more of the prefix cache, while each costs the scheduler a Python object and its free-
# queue links: a 2-layer test model (4 KiB a block) on an H200 made about 30 million blocks, and the scheduler took
# minutes and gigabytes to start. 2^20 blocks is 16.8 million tokens at block size 16.
MAX_KV_BLOCKS = 1 << 20


def cap_kv_blocks(capacity: int, cfg: EngineConfig) -> int:
    """`capacity` blocks, at most max(`MAX_KV_BLOCKS`, what max_num_seqs sequences of max_model_len tokens fill)."""
    limit = max(MAX_KV_BLOCKS, cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size))
    if capacity > limit:
        log.info("the KV cache has room for %d blocks; using %d (more would only extend the prefix cache, and "
                 "cost the scheduler start-up time and memory)", capacity, limit)
        return limit
    return capacity


def num_kv_blocks(cfg: EngineConfig, per_block: int, device: torch.device, rank: int,
                  profile_peak_memory: Callable[[], int]) -> int:
    """Blocks this rank can hold: forced (`num_kvcache_blocks`), from a fixed budget, or measured on the GPU.

    `per_block`: bytes of one block (`kv_bytes_per_block`). On a GPU, `profile_peak_memory()` runs a warm-up step
    at the largest batch and returns its peak activation bytes; the cache gets `gpu_memory_utilization` of the
    card minus weights, activations and memory outside torch (CUDA context, NCCL). A budget's count is capped by
    `cap_kv_blocks`. Raises `ExplainedError` when
    one block exceeds the CPU budget, the CPU cache exceeds the host's available memory, or the forced number of
    blocks does not fit the GPU.
    """
    if device.type == "cpu":
        budget = (cfg.kv_cache_memory_gb or 1.0) * GiB
        if not cfg.num_kvcache_blocks and budget < per_block:
            raise ExplainedError(f"one KV block ({count(cfg.block_size, 'token')}, {format_bytes(per_block)}) is "
                                 f"larger than the CPU KV-cache budget of {format_bytes(budget)}: lower "
                                 "--block-size or raise --kv-cache-memory-gb")
        num_blocks = cfg.num_kvcache_blocks or int(budget // per_block)
        available = host_memory_available()
        if available is not None and num_blocks * per_block > available:
            size = format_bytes(num_blocks * per_block)
            raise ExplainedError(f"a KV cache of {count(num_blocks, 'block')} ({size}) does not fit in this "
                                 f"host's available memory ({format_bytes(available)}): lower "
                                 "--kv-cache-memory-gb or --num-kvcache-blocks")
        return cfg.num_kvcache_blocks or cap_kv_blocks(num_blocks, cfg)
    peak_activations = profile_peak_memory()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)
    if cfg.kv_cache_memory_gb is not None:
        budget = cfg.kv_cache_memory_gb * GiB
    else:
        budget = total * cfg.gpu_memory_utilization - non_torch - weights - peak_activations
    capacity = max(0, int(budget // per_block))
    log.info("rank %d memory: total %.1f GiB, weights %.2f GiB, peak activations %.2f GiB, other %.2f GiB "
             "-> room for %d KV blocks", rank, total / GiB, weights / GiB, peak_activations / GiB,
             non_torch / GiB, capacity)
    if cfg.num_kvcache_blocks:
        if cfg.num_kvcache_blocks > capacity:
            raise ExplainedError(f"num_kvcache_blocks {cfg.num_kvcache_blocks} does not fit: this GPU has "
                                 f"room for {count(capacity, 'block')} of {format_bytes(per_block)}")
        return cfg.num_kvcache_blocks
    return cap_kv_blocks(capacity, cfg)


# ============================================================================ fp8
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448.0
CALIBRATION_SEQS = 2
CALIBRATION_LEN = 256  # tokens per calibration sequence (fewer if max_model_len is smaller)
CALIBRATION_SEED = 0
SCALE_HEADROOM = 4.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for `EngineConfig.kv_cache_dtype`: "auto" -> the model's dtype,
    "fp8" / "fp8_e4m3" -> float8 e4m3fn. Raises `ValueError` for any other name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")


def fp8_unsupported_reason(device: torch.device, backend_name: str) -> str | None:
    """Why an fp8 KV cache cannot run with this device and attention backend; None if it can."""
    if backend_name not in ("triton", "torch"):
        return f"the {backend_name} attention backend does not read an fp8 KV cache (use triton or torch)"
    if device.type == "cuda" and backend_name == "triton" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"Triton's float8 e4m3 needs compute capability 8.9 or newer (Ada, Hopper); this GPU has "
                f"{major}.{minor}")
    return None


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`e4m3(x / scale)` as float8 e4m3fn, computed in float32 as the store kernels compute it
    (`x * (1 / scale)`, rounded to nearest even, saturating at +-448)."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def scale_for(amax: float) -> float:
    """The power of two at least `SCALE_HEADROOM * amax / 448`; 1.0 when `amax` is 0 or not finite."""
    if not (0.0 < amax < math.inf):
        return 1.0
    return 2.0 ** math.ceil(math.log2(SCALE_HEADROOM * amax / FP8_E4M3_MAX))


def calibration_batch(vocab_size: int, max_model_len: int, block_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    """(input_ids `[T]` int64, positions `[T]` int64, prefill metadata, cache blocks needed) of the
    calibration prefill: `CALIBRATION_SEQS` fresh sequences, each in its own blocks."""
    seq_len = min(CALIBRATION_LEN, max_model_len)
    positions, meta = prefill_batch([seq_len] * CALIBRATION_SEQS, block_size, device)
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    input_ids = torch.randint(0, vocab_size, (CALIBRATION_SEQS * seq_len,), generator=generator)
    return input_ids.to(device), positions, meta, CALIBRATION_SEQS * -(-seq_len // block_size)


def prepare_fp8_kv_cache(model: torch.nn.Module, attn_layers: list, backend_name: str, vocab_size: int,
                         max_model_len: int, block_size: int, device: torch.device, dtype: torch.dtype,
                         rank: int = 0) -> None:
    """Set every attention layer's `k_scale` and `v_scale` for an fp8 KV cache, measured by
    `calibrate_kv_scales`. Raises `ExplainedError` when this device or backend cannot run one."""
    why = fp8_unsupported_reason(device, backend_name)
    if why is not None:
        raise ExplainedError(f"an fp8 KV cache cannot run here: {why}")
    scales = calibrate_kv_scales(model, attn_layers, vocab_size, max_model_len, block_size, device, dtype)
    for attn, (k_scale, v_scale) in zip(attn_layers, scales):
        attn.k_scale, attn.v_scale = k_scale, v_scale
    log.info("rank %d fp8 KV cache: (k_scale, v_scale) per layer %s", rank,
             " ".join(f"({k:g}, {v:g})" for k, v in scales))


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, attn_layers: list, vocab_size: int, max_model_len: int,
                        block_size: int, device: torch.device, dtype: torch.dtype) -> list[tuple[float, float]]:
    """Measure each layer's (k_scale, v_scale) for an fp8 KV cache (see the module docstring).

    Runs one prefill of the calibration batch through `model` with a temporary cache of `dtype`
    bound to `attn_layers`, which are left unbound (empty caches) afterwards. Under tensor
    parallelism every rank must call it at the same time (the maxima are all-reduced).
    """
    from workers.parallel import tp_size

    input_ids, positions, meta, num_blocks = calibration_batch(vocab_size, max_model_len, block_size, device)
    cache = allocate_kv_cache(attn_layers, num_blocks, block_size, dtype, device)
    for attn in attn_layers:
        attn.k_scale = attn.v_scale = 1.0
    try:
        model(input_ids, positions, meta)
        amax = cache.abs().amax(dim=(2, 3, 4, 5)).float()  # [2, num_layers]: keys, values
    finally:
        release_kv_cache(attn_layers)
    if tp_size() > 1:
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    amax_k, amax_v = amax.tolist()
    if not all(math.isfinite(a) for a in amax_k + amax_v):
        log.warning("the fp8 KV-cache calibration saw non-finite keys or values; those layers get scale 1.0")
    return [(scale_for(k), scale_for(v)) for k, v in zip(amax_k, amax_v)]
