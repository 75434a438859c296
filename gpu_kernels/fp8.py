"""The fp8 KV cache's number format: float8 e4m3fn (OCP 8-bit floating point, "E4M3"), with one scale.

An element is stored as `e4m3(x / scale)` and read as `float(code) * scale` (vLLM's convention):
1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; largest finite value 448, smallest normal
2^-6, subnormals in steps of 2^-9, no infinities, and 0x7F / 0xFF are NaN.

`e4m3_bits` rounds float32 to the nearest e4m3fn value, ties to even, and saturates: anything
beyond +-448 (infinities too) becomes +-448, NaN stays NaN. That is the hardware's
`cvt.rn.satfinite.e4m3x2.f32` (sm89+) and `torch.clamp(x, -448, 448).to(torch.float8_e4m3fn)`.
It is written with integer operations on the float32 bits because the Triton interpreter's own
float8 cast does not round subnormals and out-of-range values as the GPU does, and the CPU tests
must check the bytes the GPU writes. Reading needs no such care: the interpreter widens every
finite e4m3fn value exactly (only the NaN codes come out as +-480).
"""

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0

_FLOAT32_TWO_POW_MINUS_6 = tl.constexpr(0x3C800000)  # bits of 2^-6, the smallest normal e4m3 value
_FLOAT32_MAX_E4M3 = tl.constexpr(0x43E00000)  # bits of 448.0
_FLOAT32_TWO_POW_14 = tl.constexpr(0x46800000)  # bits of 2^14: its float32 ulp is 2^-9, the e4m3 subnormal step
_FLOAT32_INF = tl.constexpr(0x7F800000)


@triton.jit
def e4m3_bits(x):
    """The e4m3fn byte nearest to float32 `x` (ties to even, saturating at +-448), as uint8."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal range: keep 3 of float32's 23 mantissa bits, rounding the 20 dropped ones to nearest
    # even; a carry out of the mantissa increments the exponent, which is the correctly rounded
    # result. Rebias the exponent from 127 to 7.
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2^-6: |x| + 2^14 rounds |x| to a multiple of 2^-9 (float32 addition rounds to nearest
    # even); the low bits of the sum count those steps, 0..8 (8 is 2^-6, the first normal code).
    absolute = magnitude.to(tl.float32, bitcast=True)
    subnormal = (absolute + 16384.0).to(tl.int32, bitcast=True) - _FLOAT32_TWO_POW_14
    code = tl.where(magnitude < _FLOAT32_TWO_POW_MINUS_6, subnormal, normal)
    code = tl.where(magnitude > _FLOAT32_MAX_E4M3, 0x7E, code)
    code = tl.where(magnitude > _FLOAT32_INF, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, e4m3_bits(tl.load(x_ptr + offsets, mask=mask, other=0.0)), mask=mask)


def e4m3_codes(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The uint8 e4m3fn codes `e4m3_bits` gives a float32 tensor, same shape (to test the rounding)."""
    flat = x.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    if flat.numel():
        _e4m3_kernel[(triton.cdiv(flat.numel(), block),)](flat, out, flat.numel(), BLOCK=block)
    return out.view(x.shape)
