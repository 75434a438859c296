"""Rounding float32 to a 16-bit model dtype inside Triton kernels, as the GPU rounds it on CPU too."""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype`, to nearest even. The bfloat16 rounding is done on the bits
    because the Triton interpreter truncates that cast, and the CPU tests must see the GPU's rounding
    (`cvt.rn.bf16.f32`); finite values and infinities round exactly as the hardware does."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
