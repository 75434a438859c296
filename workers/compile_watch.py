"""Triton kernels compiled while a worker serves: counted per step and logged.

A Triton kernel is compiled for each new combination of its compile-time constants and of the
specializations Triton derives from its arguments (a pointer 16-byte aligned or not, an integer equal
to 1 or a multiple of 16). The first launch of a new variant compiles it on the host, 0.3-2 s on the
H200 (from the disk cache still tens of ms), and the step that launched it waits: a worker warms up
every variant its steps can need before it reports ready (`ModelRunner.compile_sampling`, the
profiling forward), and any compile after that is a stall the warm-up missed. This module makes them
visible: each one is logged with the kernel's name and signature, and the step that paid for it
carries `compiles` in its timings (the step log, `benchmarks/throughput.py`).

Uses Triton's `knobs.runtime.jit_post_compile_hook`, which runs once per in-memory cache miss of a
`triton.jit` function (kernels `torch.compile` generates are compiled by inductor, not counted).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("deltaserve.worker")


class CompileWatch:
    """Counts Triton compiles from `install()` on; `take()` returns the count since the last `take()`."""

    def __init__(self) -> None:
        self.total = 0
        self._untaken = 0
        self._previous: Any = None
        self._installed = False

    def install(self) -> bool:
        """Start counting (chains any hook installed before). False where Triton or its hook is missing."""
        try:
            import triton
        except ImportError:
            return False
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        self._previous = runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = self._hook
        self._installed = True
        return True

    def uninstall(self) -> None:
        if self._installed:
            import triton

            triton.knobs.runtime.jit_post_compile_hook = self._previous
            self._installed = False

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        self.total += 1
        self._untaken += 1
        log.warning("compiled Triton kernel %s while serving (the step that launched it waited for the compile; "
                    "the worker's warm-up should have compiled this variant)", kwargs.get("repr", "?"))
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def take(self) -> int:
        n, self._untaken = self._untaken, 0
        return n
