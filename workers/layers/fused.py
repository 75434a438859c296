"""`torch.compile` for the small element-wise layers (RMSNorm, SiLU-and-mul, RoPE) on CUDA.

Each of these is several element-wise torch ops; compiled, each becomes one fused kernel, which
matters at decode where a step runs hundreds of tiny kernels. On CPU, or when the worker runs
eagerly (`enforce_eager`), the plain function runs: nothing is compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)
_enabled = False


def enable_compilation(enabled: bool) -> None:
    """Set once by the model runner: compile on CUDA unless `enforce_eager`."""
    global _enabled
    _enabled = enabled


def fused(fn: F) -> F:
    """Run `fn` through `torch.compile(dynamic=True)` when compilation is on and its first argument is on a GPU."""
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if _enabled and args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
