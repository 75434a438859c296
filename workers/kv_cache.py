"""The KV cache's element type: the model's dtype, or fp8 (float8 e4m3fn) with one scale per layer
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

import numpy as np
import torch

from workers.attention.base import AttentionMetadata

log = logging.getLogger("deltaserve.worker")

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
    lens = [seq_len] * CALIBRATION_SEQS
    width = -(-seq_len // block_size)
    tables = np.arange(CALIBRATION_SEQS * width, dtype=np.int32).reshape(CALIBRATION_SEQS, width)
    positions = np.tile(np.arange(seq_len, dtype=np.int64), CALIBRATION_SEQS)
    seq_index = np.repeat(np.arange(CALIBRATION_SEQS), seq_len)
    slots = tables[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
    qsl = np.arange(CALIBRATION_SEQS + 1, dtype=np.int32) * seq_len
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device), query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=torch.from_numpy(tables).to(device),
        max_query_len=seq_len, max_seq_len=seq_len, is_decode=False, query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array(lens, dtype=np.int32))
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    input_ids = torch.randint(0, vocab_size, (CALIBRATION_SEQS * seq_len,), generator=generator)
    return input_ids.to(device), torch.from_numpy(positions).to(device), meta, CALIBRATION_SEQS * width


def prepare_fp8_kv_cache(model: torch.nn.Module, attn_layers: list, backend_name: str, vocab_size: int,
                         max_model_len: int, block_size: int, device: torch.device, dtype: torch.dtype,
                         rank: int = 0) -> None:
    """Set every attention layer's `k_scale` and `v_scale` for an fp8 KV cache, measured by
    `calibrate_kv_scales`. Raises `ExplainedError` when this device or backend cannot run one."""
    from common.errors import ExplainedError

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
    layer = attn_layers[0]
    cache = torch.zeros(2, len(attn_layers), num_blocks, block_size, layer.num_kv_heads, layer.head_dim,
                        dtype=dtype, device=device)
    for i, attn in enumerate(attn_layers):
        attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
        attn.k_scale = attn.v_scale = 1.0
    try:
        model(input_ids, positions, meta)
        amax = cache.abs().amax(dim=(2, 3, 4, 5)).float()  # [2, num_layers]: keys, values
    finally:
        for attn in attn_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
    if tp_size() > 1:
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    amax_k, amax_v = amax.tolist()
    if not all(math.isfinite(a) for a in amax_k + amax_v):
        log.warning("the fp8 KV-cache calibration saw non-finite keys or values; those layers get scale 1.0")
    return [(scale_for(k), scale_for(v)) for k, v in zip(amax_k, amax_v)]
