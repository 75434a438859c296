"""Fused kernels on CUDA: `torch.compile` for the small element-wise layers (RMSNorm, SiLU-and-mul,
RoPE), and the switch for hand-written Triton fusions (`gpu_kernels/rope_kv_store.py`).

Each of these layers is several element-wise torch ops; compiled, each becomes one fused kernel,
which matters at decode where a step runs hundreds of tiny kernels. On CPU, or when the worker
runs eagerly (`enforce_eager`), the plain functions run: nothing is compiled or fused. Tests can
force the Triton fusions on CPU tensors (under `TRITON_INTERPRET=1`) with `force_fused_kernels`.

Compiled layers round as eager torch does: inductor's `emulate_precision_casts` keeps every cast to the model
dtype that the layer's code makes (by default a fused kernel skips them, so `x + residual` entered the norm
unrounded while the residual stream kept it rounded). On the trained demo model (benchmarks/gpu_correctness.py,
gate 2, H200, 2026-12-03) CUDA-graph runs then agreed with transformers fp32 on 19 of 32 prompts instead of 14
(eager: 16; transformers bf16: 15), and no longer diverged at the prefill's token.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from workers.deterministic import deterministic

F = TypeVar("F", bound=Callable)
_enabled = False
_forced = False


def enable_compilation(enabled: bool) -> None:
    """Set once by the model runner: compile on CUDA unless `enforce_eager`."""
    global _enabled
    _enabled = enabled


def fused_kernels_enabled(x: torch.Tensor) -> bool:
    """Whether a Triton fusion replaces the unfused layers for tensor `x`: compilation is on and `x`
    is on a GPU, or the fusions are forced (tests)."""
    return _forced or (_enabled and x.is_cuda)


def qk_norm_rope_store_fused(x: torch.Tensor) -> bool:
    """Whether the fused QK-norm + RoPE + KV-store kernel (`gpu_kernels/rope_kv_store.py`) replaces those layers for
    the qkv projection output `x`: wherever the fused kernels are on, and in deterministic mode on a GPU too. It is
    batch-invariant: one program per token and head, whose norm sums one head in a block fixed by the head size,
    the rest element-wise; in its place deterministic mode ran about 14 small kernels a layer (RoPE in float32
    pieces, the concatenations, the store): 0.6 ms of a 3.1 ms batch-1 step on Qwen3-0.6B (H200, 2026-12-06)."""
    return fused_kernels_enabled(x) or (x.is_cuda and deterministic())


@contextlib.contextmanager
def force_fused_kernels() -> Iterator[None]:
    """Within the block, use the Triton fusions whatever the device (tests).

    On CPU the kernels run under the Triton interpreter, so `TRITON_INTERPRET=1` must be set
    before `gpu_kernels` is first imported.
    """
    global _forced
    saved, _forced = _forced, True
    try:
        yield
    finally:
        _forced = saved


def fused(fn: F) -> F:
    """Run `fn` through `torch.compile(dynamic=True)`, rounding as eager torch does (see the module docstring),
    when compilation is on and its first argument is on a GPU."""
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if _enabled and args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
