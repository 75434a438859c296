"""The worker's count of Triton compiles after its warm-up (workers/compile_watch.py). Triton's interpreter
(CPU) compiles nothing, so the hook is driven here as Triton drives it; tests/test_gpu.py checks on the GPU
that an engine's steps compile nothing."""

from __future__ import annotations

import logging

import pytest
import triton

from workers.compile_watch import CompileWatch


def _compile_event(name: str) -> None:
    """What Triton does after compiling a variant: call the post-compile hook with keyword arguments."""
    hook = triton.knobs.runtime.jit_post_compile_hook
    if hook is not None:
        hook(key=(name,), repr=f"{name}[num_warps=4](x_ptr: *bf16)", fn=None, compile={}, is_manual_warmup=False,
             already_compiled=False)


def test_compiles_are_counted_per_take_logged_and_chained(caplog: pytest.LogCaptureFixture) -> None:
    earlier: list[str] = []
    saved = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw["repr"])
    watch = CompileWatch()
    try:
        assert watch.install()
        _compile_event("_chunk_argmax_kernel")
        with caplog.at_level(logging.WARNING, logger="deltaserve.worker"):
            _compile_event("_paged_prefill_kernel")
        assert watch.take() == 2 and watch.take() == 0
        assert "compiled Triton kernel _paged_prefill_kernel[num_warps=4](x_ptr: *bf16) while serving" in caplog.text
        assert len(earlier) == 2  # a hook installed before still runs
        watch.uninstall()
        _compile_event("_gemv_kernel")
        assert watch.take() == 0 and watch.total == 2 and len(earlier) == 3
    finally:
        watch.uninstall()
        triton.knobs.runtime.jit_post_compile_hook = saved
