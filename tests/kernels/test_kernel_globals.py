"""Every global a Triton kernel reads must be one the GPU compiler accepts.

Under ``TRITON_INTERPRET=1`` (how CI runs the kernels) a ``@triton.jit`` function is plain Python and may read
any module global; the real compiler accepts only ``tl.constexpr`` values, other jitted functions, modules and
a few builtins. A plain ``int`` global once passed every CPU test and failed on the H200 with "Cannot access
global variable ... from within @jit'ed function" (the fp8 KV cache's bit constants), so this test reads each
kernel's globals as the compiler would.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import pytest
import triton
import triton.language as tl

import gpu_kernels

# Under TRITON_INTERPRET=1 triton.jit makes an InterpretedFunction, on a GPU a JITFunction: both are
# KernelInterfaces holding the Python function as .fn.
_KERNEL = triton.runtime.KernelInterface


def _jitted_functions() -> list[tuple[str, _KERNEL]]:
    found = []
    for info in pkgutil.iter_modules(gpu_kernels.__path__):
        module = importlib.import_module(f"gpu_kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, _KERNEL) and value.fn.__module__ == module.__name__:
                found.append((f"{module.__name__}.{name}", value))
    return found


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _accepted_by_the_compiler(value: object) -> bool:
    return (
        isinstance(value, (tl.constexpr, _KERNEL, types.ModuleType))
        or inspect.isclass(value)
        or callable(value)  # builtins such as min/max/range and tl's own functions
    )


JITTED = _jitted_functions()


def test_the_kernel_modules_are_found() -> None:
    assert len(JITTED) >= 8, [name for name, _ in JITTED]


@pytest.mark.parametrize(("name", "kernel"), JITTED, ids=[name for name, _ in JITTED])
def test_every_global_a_kernel_reads_is_a_constexpr_a_function_or_a_module(name: str, kernel) -> None:
    module_globals = kernel.fn.__globals__
    offending = {
        global_name: type(module_globals[global_name]).__name__
        for global_name in _global_names(kernel.fn.__code__)
        if global_name in module_globals and not _accepted_by_the_compiler(module_globals[global_name])
    }
    assert not offending, f"{name} reads non-constexpr globals {offending}: wrap them in tl.constexpr(...)"
