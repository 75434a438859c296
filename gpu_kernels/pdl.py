"""Programmatic dependent launch (PDL) for the decode step's kernels (CUDA, compute capability 9.0 and later).

Between two kernels of one stream the GPU lets the first drain before it launches the second: a gap of idle SMs
at every boundary, which at a batch-1 decode step (about 200 kernels of 3 to 7 us each) is a large share of the
step. With PDL a kernel is launched while its predecessor still runs (NVIDIA, "CUDA C++ Programming Guide",
Programmatic Dependent Launch and Synchronization). Each kernel of ours that takes part waits inside, before its
first load or store, for its predecessor to finish and flush its memory (`griddepcontrol.wait`, Triton's
`tl.extra.cuda.gdc_wait`), and once its main loop is done lets its own successor launch
(`griddepcontrol.launch_dependents`). So every memory effect keeps a plain stream's order; only the launch latency
overlaps. A kernel that does not take part (torch's, cuBLAS's) is launched and waited for as before. CUDA graphs
keep the dependencies as programmatic edges.

On unless `DELTASERVE_PDL=0` (read once); never for CPU tensors (the Triton interpreter). On the H200 it took a
batch-1 decode step from 1.17 to 1.03 ms (benchmarks/RESULTS.md, 2026-12-02 fourth session).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common import envs


@functools.cache
def _requested() -> bool:
    return envs.pdl()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_for(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` (on its device) launch with PDL: requested, CUDA, capability >= 9.0."""
    return t.is_cuda and _requested() and _capable(t.device.index if t.device.index is not None else 0)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The extra launch keyword of a kernel launched with PDL (none without, so the interpreter never sees it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """In a kernel with no main loop to overlap: with PDL, wait for the kernel before (it has finished and its
    writes are visible), then let the next one launch at once (it waits for this one in turn). Call it before the
    kernel's first load or store."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
