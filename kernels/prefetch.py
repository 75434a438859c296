"""Asking L2 for data a kernel will read soon: `cp.async.bulk.prefetch.L2.global` (PTX ISA 8.0, sm_90+).

A bulk prefetch is a hint with no destination: it holds no register and no scoreboard, so the thread goes on at once
and the bytes arrive in L2 while it (and the kernels after it) work. With programmatic dependent launch
(kernels/pdl.py) a kernel is launched while the one before it still runs and waits inside for it; what it will read
that no kernel of the step writes (weights, the KV of earlier tokens) it can ask for before that wait, so the
memory's latency overlaps the kernel before. L2 is the GPU's point of coherence: a line prefetched while another
kernel writes it holds the written bytes when read after the wait.

Compiled only for CUDA (inline PTX): callers test a constexpr flag that is false under the Triton interpreter.
"""

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs, sizes):
    """One bulk prefetch per element: `sizes` bytes (int32, a multiple of 16; <= 0 asks for nothing) from `ptrs`
    (pointers, 16-byte aligned). Give each thread one element (a tensor of the program's thread count) so that no
    range is asked for twice."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs.to(tl.pointer_type(tl.uint8)), sizes], dtype=tl.int32, is_pure=False, pack=1,
    )
