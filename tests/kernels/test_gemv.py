"""gemv computes `x @ W.T + bias` as float32 sums of exact products, rounded once to x's dtype, the same bits on
every call; the linear layers and the LM head take it at small batch when the fused kernels are on, and a model
run with it gives the logits and tokens of the model run with cuBLAS (here F.linear).

Runs under the Triton interpreter on CPU when there is no GPU (see conftest.py), on small shapes: the
interpreter costs about half a microsecond per loaded element. The launch configurations that the GPU heuristic
picks are run here explicitly (`choose_gemv_config`), since CPU tensors get the interpreter's own configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import gpu_kernels.gemv as gemv_module  # noqa: E402
from gpu_kernels import split_counters  # noqa: E402
from gpu_kernels.gemv import (  # noqa: E402
    GemvConfig,
    add_rms_norm_gemv,
    choose_gemv_config,
    gemv,
    silu_and_mul_gemv,
)
from tests.kernels.hopper_compile import run_compile_script  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]
# Significand bits of each dtype (with the implicit one): rounding to nearest moves a value by at most
# |value| * 2^-bits.
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11}


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    return x, weight, bias


def assert_rounded_float32_sum(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                               ) -> None:
    """y is the exact float64 `x @ W.T + bias` up to float32 summation error (K additions of at most 2^-24 of
    the running sum of magnitudes) and one rounding to y's dtype."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0]) and y.is_contiguous()
    ref = x.double() @ weight.double().T
    magnitudes = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        ref += bias.double()
        magnitudes += bias.double().abs()
    summation = (x.shape[1] + 1) * 2.0**-24 * magnitudes
    tolerance = ref.abs() * 2.0 ** -SIGNIFICAND_BITS[y.dtype] + summation * (1 + 2.0 ** -SIGNIFICAND_BITS[y.dtype])
    error = (y.double() - ref).abs()
    worst = (error - tolerance).argmax()
    assert (error <= tolerance).all(), (f"y {y.flatten()[worst].item()} vs {ref.flatten()[worst].item()} "
                                        f"(tolerance {tolerance.flatten()[worst].item():.3g})")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("n", "k"), [(100, 70), (257, 520)])
def test_gemv_with_the_gpu_configuration_is_the_rounded_float32_product(dtype: torch.dtype, m: int, with_bias: bool,
                                                                        n: int, k: int) -> None:
    """N and K are not multiples of any block; (257, 520) is split over K at every M."""
    x, weight, bias = make_inputs(m, n, k, dtype, with_bias, seed=m * n + k)
    config = choose_gemv_config(m, n, k, num_sms=132)
    if (n, k) == (257, 520):
        assert config.split_k > 1

    assert_rounded_float32_sum(gemv(x, weight, bias, config=config), x, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_gemv_with_its_own_configuration_is_the_rounded_float32_product(dtype: torch.dtype, m: int) -> None:
    x, weight, bias = make_inputs(m, 1100, 200, dtype, True, seed=m)

    assert_rounded_float32_sum(gemv(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("config", [
    GemvConfig(block_n=16, block_k=16, split_k=1, use_dot=True),
    GemvConfig(block_n=16, block_k=16, split_k=4, use_dot=True),
    GemvConfig(block_n=32, block_k=32, split_k=7, use_dot=False),
    GemvConfig(block_n=128, block_k=64, split_k=100, use_dot=True),  # more splits than K blocks: runs 3
    GemvConfig(block_n=16, block_k=64, split_k=2, use_dot=False),  # one program per batch row, any M
], ids=["dot", "dot-split4", "fma-split7", "dot-split100", "fma-rows"])
def test_gemv_is_the_same_product_in_every_configuration(config: GemvConfig) -> None:
    x, weight, bias = make_inputs(5, 90, 150, torch.bfloat16, True, seed=7)

    assert_rounded_float32_sum(gemv(x, weight, bias, config=config), x, weight, bias)


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_gives_the_same_bits_on_a_second_call(m: int) -> None:
    x, weight, bias = make_inputs(m, 257, 520, torch.bfloat16, True, seed=3)
    config = choose_gemv_config(m, 257, 520, num_sms=132)
    assert config.split_k > 1

    first = gemv(x, weight, bias, config=config)
    second = gemv(x, weight, bias, config=config)

    assert torch.equal(first, second)


SPLIT_CONFIGS = [
    GemvConfig(block_n=32, block_k=32, split_k=7, use_dot=False),
    GemvConfig(block_n=16, block_k=64, split_k=3, use_dot=False),
    GemvConfig(block_n=16, block_k=16, split_k=5, use_dot=True),
]
SPLIT_IDS = ["fma-split7", "fma-split3", "dot-split5"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=SPLIT_IDS)
def test_one_launch_split_k_gives_the_bits_of_the_two_launch_sum(dtype: torch.dtype, m: int,
                                                                 config: GemvConfig) -> None:
    """The last split to arrive adds every split's partial in split order, as the second kernel does."""
    x, weight, bias = make_inputs(m, 90, 150, dtype, True, seed=m)

    one = gemv(x, weight, bias, config=config)
    two = gemv(x, weight, bias, config=dataclasses.replace(config, one_launch=False))

    assert torch.equal(one, two)
    assert_rounded_float32_sum(one, x, weight, bias)


def test_one_launch_split_k_leaves_its_counters_zero_so_every_call_gives_the_same_bits() -> None:
    """As a CUDA graph replays it: the same launch again and again, each finding the counters as the last left them."""
    x, weight, bias = make_inputs(1, 257, 520, torch.bfloat16, True, seed=5)
    config = choose_gemv_config(1, 257, 520, num_sms=132)
    assert config.split_k > 1 and config.one_launch

    results = [gemv(x, weight, bias, config=config) for _ in range(4)]

    assert all(torch.equal(results[0], y) for y in results[1:])
    assert not split_counters._counters[x.device].any()


def test_a_split_grid_larger_than_the_counters_gets_a_larger_workspace_and_the_old_one_stays_alive() -> None:
    """A graph captured with the smaller workspace still points at it, so it must never be freed."""
    x, weight, bias = make_inputs(1, 40, 64, torch.float16, True, seed=2)
    gemv(x, weight, bias, config=GemvConfig(block_n=16, block_k=16, split_k=2, use_dot=False))
    small = split_counters._counters[x.device]
    tiles = small.numel() + 1  # one W row per tile
    x, weight, bias = make_inputs(1, tiles * 16, 32, torch.float16, True, seed=3)

    y = gemv(x, weight, bias, config=GemvConfig(block_n=16, block_k=16, split_k=2, use_dot=False))

    # at least `tiles` (a first allocation may reserve more, and another kernel of this process may have made it)
    assert split_counters._counters[x.device].numel() >= tiles
    assert split_counters._counters[x.device] is not small
    assert any(old is small for old in split_counters._retired_counters)
    assert_rounded_float32_sum(y, x, weight, bias)


def test_gemv_rounds_to_nearest_even_like_the_gpu() -> None:
    """1 + 2^-8 + 2^-9 lies past the midpoint of two bfloat16 neighbours (1 and 1 + 2^-7): truncation, what the
    interpreter's own float32 -> bfloat16 cast does, would give 1."""
    x = torch.tensor([[1.0, 2.0**-8, 2.0**-9]], dtype=torch.bfloat16)
    weight = torch.ones(1, 3, dtype=torch.bfloat16)

    assert gemv(x, weight).item() == 1.0 + 2.0**-7


def test_gemv_of_an_empty_batch_or_an_empty_input_dimension() -> None:
    weight = torch.randn(10, 4).bfloat16()
    assert gemv(torch.empty(0, 4, dtype=torch.bfloat16), weight).shape == (0, 10)
    bias = torch.randn(10).bfloat16()
    y = gemv(torch.empty(3, 0, dtype=torch.bfloat16), torch.empty(10, 0, dtype=torch.bfloat16), bias)
    assert torch.equal(y, bias.expand(3, 10))


def test_gemv_reads_x_with_a_row_stride() -> None:
    """A column slice of a wider tensor (last stride 1, row stride larger than K) needs no copy."""
    wide, weight, bias = make_inputs(3, 40, 96, torch.float16, True, seed=11)
    x = wide[:, 10:74]
    weight = weight[:, :64].contiguous()

    assert_rounded_float32_sum(gemv(x, weight, bias), x.contiguous(), weight, bias)


def test_gemv_refuses_bad_shapes_dtypes_and_layouts() -> None:
    x = torch.randn(2, 8).bfloat16()
    weight = torch.randn(6, 8).bfloat16()
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemv(x[0], weight)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemv(x, weight[None])
    with pytest.raises(ValueError, match="x has 8 input features but weight"):
        gemv(x, torch.randn(6, 9).bfloat16())
    with pytest.raises(ValueError, match="weight dtype torch.float32 must be one of"):
        gemv(x.float(), weight.float())
    with pytest.raises(ValueError, match="x dtype torch.float16 must equal the weight dtype torch.bfloat16"):
        gemv(x.half(), weight)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gemv(x, torch.randn(8, 6).bfloat16().T)
    with pytest.raises(ValueError, match="x must have stride 1 in its last dimension"):
        gemv(torch.randn(8, 2).bfloat16().T, weight)
    with pytest.raises(ValueError, match=r"bias torch.bfloat16 \(5,\)"):
        gemv(x, weight, torch.randn(5).bfloat16())
    with pytest.raises(ValueError, match=r"bias torch.float32 \(6,\)"):
        gemv(x, weight, torch.randn(6))
    with pytest.raises(ValueError, match="bias must be contiguous"):
        gemv(x, weight, torch.randn(12).bfloat16()[::2])


@pytest.mark.parametrize(("field", "value"), [("block_n", 24), ("block_k", 8), ("split_k", 0), ("num_warps", 3),
                                              ("num_stages", 0)])
def test_gemv_config_refuses_values_the_kernel_cannot_run(field: str, value: int) -> None:
    fields = dict(block_n=64, block_k=128, split_k=1, use_dot=True)
    fields[field] = value
    with pytest.raises(ValueError, match=f"GemvConfig.{field} must be"):
        GemvConfig(**fields)


# A fresh process compiles the kernels for sm90 (no GPU needed: Triton ships ptxas), since in this one they are
# interpreted. Printed: for each variant, the instructions that make the design's point.
HOPPER_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import gpu_kernels.gemv as g

def variant(use_dot, split, even_k, has_bias, block_n, block_k, one_launch=True, silu_mul=False, rms_norm=False,
            pdl=False):
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16",
           "partial_ptr": "*fp32" if split else "*bf16", "counter_ptr": "*i32" if split and one_launch else "*bf16",
           "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "h_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "k_per_split": "i32",
           "eps": "fp32"}
    constexprs = {"BLOCK_M": 16 if use_dot else 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": use_dot,
                  "HAS_BIAS": has_bias, "SPLIT": split, "ONE_LAUNCH": split and one_launch, "EVEN_K": even_k,
                  "WIDEN_DOT": False, "SILU_MUL": silu_mul, "RMS_NORM": rms_norm, "HAS_RESIDUAL": rms_norm,
                  "PDL": pdl}
    sig.update({name: "constexpr" for name in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 14)}
    kernel = triton.compile(ASTSource(fn=g._gemv_kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    ops = ("wgmma.mma_async", "cp.async", "ld.global.v4", "atom.global.gpu.acq_rel", "ld.global.cg", "bar.sync",
           "div.rn.f32", "div.full.f32", "ex2.approx", "rsqrt.approx", "griddepcontrol.wait",
           "griddepcontrol.launch_dependents")
    return {op: len(re.findall(re.escape(op), ptx)) for op in ops}

reduce_sig = {"partial_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
              "stride_ym": "i32", "num_splits": "i32", "BLOCK": "constexpr", "HAS_BIAS": "constexpr"}
triton.compile(ASTSource(fn=g._sum_splits_kernel, signature=reduce_sig, constexprs={"BLOCK": 1024, "HAS_BIAS": True}),
               target=GPUTarget("cuda", 90, 32))
print(json.dumps({"dot": variant(True, True, True, False, 64, 128),
                  "dot-two-launch": variant(True, True, True, False, 64, 128, one_launch=False),
                  "dot-masked": variant(True, False, False, True, 16, 16),
                  "fma": variant(False, True, True, False, 32, 256),
                  "fma-masked": variant(False, False, False, True, 32, 256),
                  "silu": variant(False, True, True, False, 32, 256, silu_mul=True),
                  "norm": variant(False, True, False, True, 32, 256, rms_norm=True),
                  "norm-pdl": variant(False, True, False, True, 32, 256, rms_norm=True, pdl=True),
                  "dot-pdl": variant(True, True, True, False, 64, 128, pdl=True)}))
"""


def test_the_kernels_compile_for_hopper_with_tensor_cores_and_vector_loads() -> None:
    pytest.importorskip("triton.backends.nvidia")
    ops = run_compile_script(HOPPER_COMPILE)

    # The dot path: wgmma fed by cp.async copies (Triton's software pipeline); the one-row path: 16-byte loads.
    assert ops["dot"]["wgmma.mma_async"] > 0 and ops["dot"]["cp.async"] > 0
    assert ops["fma"]["ld.global.v4"] > 0 and ops["fma"]["wgmma.mma_async"] == 0
    # One launch: a barrier, then the acquire-release counter, then the partials read from L2; none in two launches.
    for name in ("dot", "fma", "silu", "norm"):
        assert ops[name]["bar.sync"] > 0 and ops[name]["atom.global.gpu.acq_rel"] > 0 and ops[name]["ld.global.cg"] > 0
    assert ops["dot-two-launch"]["atom.global.gpu.acq_rel"] == 0
    # The prologues: SiLU's division and exp as torch.compile's kernel has them, the norm's rsqrt and mean.
    assert ops["silu"]["div.full.f32"] > 0 and ops["silu"]["ex2.approx"] > 0
    assert ops["norm"]["rsqrt.approx"] > 0 and ops["norm"]["div.rn.f32"] > 0 and ops["fma"]["div.full.f32"] == 0
    # DELTASERVE_PDL (gpu_kernels/pdl.py): the wait for the kernel before, and the early launch of the one after; none
    # without it.
    for name in ("norm-pdl", "dot-pdl"):
        assert ops[name]["griddepcontrol.wait"] == 1 and ops[name]["griddepcontrol.launch_dependents"] == 1, ops[name]
    assert ops["norm"]["griddepcontrol.wait"] == 0 and ops["dot"]["griddepcontrol.launch_dependents"] == 0


# ---------------------------------------------------------------------------------------- fused prologues
# Through an identity weight (W = I, K x K) the GEMV's output is its input features exactly (one exact product per
# output, rounded to a value already in the dtype), so these tests see the prologue's values themselves.

PROLOGUE_CONFIGS = [None, GemvConfig(block_n=32, block_k=256, split_k=3, use_dot=False),
                    GemvConfig(block_n=64, block_k=64, split_k=5, use_dot=False)]
PROLOGUE_IDS = ["interpreter", "gpu-like", "split5"]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values lie between a and b (16-bit floats of one sign, as in these tests; -0 is 0)."""
    return ((a + 0.0).view(torch.int16).int() - (b + 0.0).view(torch.int16).int()).abs()


def silu_mul_as_eager(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` as eager torch rounds it, and the compiled layer too (emulate_precision_casts):
    silu(gate) = gate / (1 + exp(-gate)) in float32 rounded to the dtype, times up in float32, rounded."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    silu = (gate / (1 + torch.exp(-gate))).to(gate_up.dtype).float()
    return (silu * up).to(gate_up.dtype)


def rms_norm_as_eager(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of h as eager torch rounds it, and the compiled layer too: weight * round(h * rsqrt(mean(h^2) +
    eps)) in float32, rounded."""
    h32 = h.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype).float()
    return (weight.float() * normed).to(h.dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100) in float32 is inf, as on the GPU
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k", [300, 520])
def test_the_silu_prologue_rounds_silu_then_the_product_as_eager_torch(dtype: torch.dtype, k: int) -> None:
    """K = 300 and 520 are no multiple of the 256-wide block; large |gate| saturates exp (silu(-100) = -0)."""
    gate_up = (torch.randn(1, 2 * k, generator=torch.Generator().manual_seed(k)) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])

    features = silu_and_mul_gemv(gate_up, torch.eye(k, dtype=dtype))

    assert torch.equal(features, silu_mul_as_eager(gate_up))
    # The CPU layer itself: its exp may differ from libdevice's in the last float32 bit, rarely a rounding apart.
    from workers.layers.activation import silu_and_mul
    apart = ulps_apart(features, silu_and_mul(gate_up))
    assert apart.max() <= 1 and (apart > 0).sum() <= k // 100


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", PROLOGUE_CONFIGS, ids=PROLOGUE_IDS)
@pytest.mark.parametrize(("n", "k"), [(100, 300), (257, 520)])
def test_silu_and_mul_gemv_is_the_gemv_of_the_rounded_silu_product(dtype: torch.dtype, config: GemvConfig | None,
                                                                   n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n + k)
    gate_up = torch.randn(1, 2 * k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    features = silu_mul_as_eager(gate_up)

    y = silu_and_mul_gemv(gate_up, weight, bias, config=config)

    assert torch.equal(y, gemv(features, weight, bias, config=config))
    assert_rounded_float32_sum(y, features, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", PROLOGUE_CONFIGS, ids=PROLOGUE_IDS)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_the_norm_prologue_is_the_rounded_rms_norm_of_the_rounded_residual_sum(
        dtype: torch.dtype, config: GemvConfig | None, with_residual: bool) -> None:
    k, eps = 300, 1e-6
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=generator).to(dtype)
    residual = torch.randn(1, k, generator=generator).to(dtype) if with_residual else None
    norm_weight = (torch.rand(k, generator=generator) + 0.5).to(dtype)

    features, h = add_rms_norm_gemv(x, residual, norm_weight, eps, torch.eye(k, dtype=dtype), config=config)

    if with_residual:
        assert torch.equal(h, x + residual) and h.data_ptr() not in (x.data_ptr(), residual.data_ptr())
        assert torch.equal(residual, residual.clone()) and h.is_contiguous()
    else:
        assert h is x
    # inv_rms is summed in the kernel's own order: a feature may round the other way where it differs in its
    # last float32 bits; none did on these inputs.
    expected = rms_norm_as_eager(h, norm_weight, eps)
    assert torch.equal(features, expected)
    from workers.layers.norm import rms_norm  # the CPU layer (eager), summing the mean square in its own order
    apart = ulps_apart(features, rms_norm(h, norm_weight, eps))
    assert apart.max() <= 1 and (apart > 0).sum() <= k // 50


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", PROLOGUE_CONFIGS, ids=PROLOGUE_IDS)
@pytest.mark.parametrize(("n", "k"), [(100, 300), (257, 520)])
def test_add_rms_norm_gemv_is_the_gemv_of_the_norm_and_returns_the_new_residual(
        dtype: torch.dtype, config: GemvConfig | None, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n * k)
    x, residual = (torch.randn(1, k, generator=generator).to(dtype) for _ in range(2))
    norm_weight = (torch.rand(k, generator=generator) + 0.5).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)

    y, h = add_rms_norm_gemv(x, residual, norm_weight, 1e-6, weight, bias, config=config)

    features = rms_norm_as_eager(x + residual, norm_weight, 1e-6)
    assert torch.equal(h, x + residual)
    assert torch.equal(y, gemv(features, weight, bias, config=config))


def test_the_fused_gemvs_give_the_same_bits_on_every_call_with_split_k() -> None:
    generator = torch.Generator().manual_seed(1)
    gate_up, x, residual = (torch.randn(1, 2 * 520, generator=generator).bfloat16(),
                            torch.randn(1, 520, generator=generator).bfloat16(),
                            torch.randn(1, 520, generator=generator).bfloat16())
    weight, norm_weight = torch.randn(257, 520, generator=generator).bfloat16(), torch.ones(520).bfloat16()
    config = choose_gemv_config(1, 257, 520, num_sms=132)
    assert config.split_k > 1

    silu_runs = [silu_and_mul_gemv(gate_up, weight, config=config) for _ in range(3)]
    norm_runs = [add_rms_norm_gemv(x, residual, norm_weight, 1e-6, weight, config=config) for _ in range(3)]

    assert all(torch.equal(silu_runs[0], y) for y in silu_runs[1:])
    assert all(torch.equal(norm_runs[0][0], y) and torch.equal(norm_runs[0][1], h) for y, h in norm_runs[1:])


def test_the_fused_gemvs_refuse_bad_inputs() -> None:
    x, weight = torch.randn(1, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    with pytest.raises(ValueError, match=r"x has 8 input features .*x must have 16"):
        silu_and_mul_gemv(x, weight)
    with pytest.raises(ValueError, match="use_dot must be False"):
        silu_and_mul_gemv(torch.randn(1, 16).bfloat16(), weight,
                          config=GemvConfig(block_n=16, block_k=16, split_k=1, use_dot=True))
    with pytest.raises(ValueError, match="residual torch.float16"):
        add_rms_norm_gemv(x, x.half(), torch.ones(8).bfloat16(), 1e-6, weight)
    with pytest.raises(ValueError, match=r"norm_weight torch.float32 \(8,\)"):
        add_rms_norm_gemv(x, x, torch.ones(8), 1e-6, weight)
    with pytest.raises(ValueError, match=r"norm_weight torch.bfloat16 \(6,\)"):
        add_rms_norm_gemv(x, x, torch.ones(6).bfloat16(), 1e-6, weight)


# ---------------------------------------------------------------------------------------- the heuristic


@pytest.mark.parametrize(("m", "n", "k", "expected"), [
    (1, 4096, 1024, GemvConfig(block_n=32, block_k=256, split_k=4, use_dot=False)),  # 0.6B qkv: 128 tiles x 4
    (8, 4096, 1024, GemvConfig(block_n=64, block_k=128, split_k=8, use_dot=True)),  # 64 tiles x 8
    (16, 1024, 2048, GemvConfig(block_n=64, block_k=128, split_k=8, use_dot=True)),  # o: partials <= 1/8 of W
    (1, 151936, 1024, GemvConfig(block_n=32, block_k=256, split_k=1, use_dot=False)),  # LM head: 4748 tiles
    (1, 4096, 12288, GemvConfig(block_n=32, block_k=256, split_k=5, use_dot=False)),  # 8B down
    (4, 24576, 4096, GemvConfig(block_n=64, block_k=128, split_k=2, use_dot=True)),  # 8B gate_up: 384 tiles
])
def test_the_heuristic_fills_132_sms_with_four_programs_each(m: int, n: int, k: int, expected: GemvConfig) -> None:
    assert choose_gemv_config(m, n, k, num_sms=132) == expected


def test_the_heuristic_never_splits_past_one_block_per_split_or_below_16_wide_blocks() -> None:
    config = choose_gemv_config(2, 10, 20, num_sms=132)
    assert (config.block_n, config.block_k) == (16, 32)
    assert config.split_k == 1  # 20 // (16 * 2) = 0 slices' worth of partials: no split


# ---------------------------------------------------------------------------------------- dispatch


def count_gemv_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the x shape of every gemv call (the kernel still runs)."""
    calls: list[tuple[int, ...]] = []
    kernel = gemv_module.gemv

    def counted(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counted)
    return calls


def test_linear_takes_gemv_only_for_small_16_bit_batches_with_the_fused_kernels_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.layers.fused import force_fused_kernels
    from workers.layers.linear import linear

    calls = count_gemv_calls(monkeypatch)
    x, weight, bias = make_inputs(9, 24, 32, torch.bfloat16, True, seed=0)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert torch.allclose(linear(x, weight, bias, 8).float(), expected, rtol=1e-2, atol=1e-1)
    assert calls == []  # fused kernels off (CPU, not forced)
    with force_fused_kernels():
        for rows in (1, 8):
            torch.testing.assert_close(linear(x[:rows], weight, bias, 8), gemv(x[:rows], weight, bias))
        assert calls == [(1, 32), (8, 32)]
        linear(x, weight, bias, 8)  # 9 rows > 8
        linear(x[:1], weight, bias, 0)  # 0 turns it off
        linear(x[:1].float(), weight.float(), bias.float(), 8)  # float32
        linear(x[:1], weight.T.contiguous().T, bias, 8)  # a weight that is not contiguous
        linear(x[:0], weight, bias, 8)  # an empty batch
        assert calls == [(1, 32), (8, 32)]


def test_layers_read_the_maximum_batch_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.layers.embedding import ParallelLMHead
    from workers.layers.linear import ReplicatedLinear

    monkeypatch.setenv("DELTASERVE_GEMV_MAX_BATCH", "3")
    assert ReplicatedLinear(4, 4).gemv_max_batch == ParallelLMHead(10, 4).gemv_max_batch == 3
    monkeypatch.delenv("DELTASERVE_GEMV_MAX_BATCH")
    assert ReplicatedLinear(4, 4).gemv_max_batch == 1


# ---------------------------------------------------------------------------------------- whole model


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> dict[str, Path]:
    """A tiny Qwen3 and a tiny Llama with every bias, both with a 20,480-token vocabulary: the prompts' ids are
    below 20,000, and under the interpreter the LM head is most of the cost (half a second per call here)."""
    from tests.conftest import make_tiny_checkpoint

    return {
        "qwen3": make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("gemv-qwen3"), qwen3_tokenizer_dir,
                                      vocab_size=20480),
        "llama-bias": make_tiny_checkpoint("llama", tmp_path_factory.mktemp("gemv-llama"), qwen3_tokenizer_dir,
                                           vocab_size=20480, attention_bias=True, mlp_bias=True),
    }


def run_model(model: Path, gemv_max_batch: int, monkeypatch: pytest.MonkeyPatch
              ) -> tuple[list[list[int]], list[torch.Tensor], list[tuple[int, ...]]]:
    """Prefill three prompts (17 tokens: cuBLAS's) then decode them for 3 steps (3 rows: GEMV's, unless
    `gemv_max_batch` is below 3) through a CPU ModelRunner in bfloat16, with the fused kernels forced on.

    Returns (tokens per step, logits per step, the x shape of every gemv call)."""
    from common.config import EngineConfig
    from common.protocol import NewRequest, StepPlan, i32
    from tests.conftest import synthetic_prompt
    from workers.layers.fused import force_fused_kernels
    from workers.model_runner import ModelRunner

    monkeypatch.setenv("DELTASERVE_GEMV_MAX_BATCH", str(gemv_max_batch))
    cfg = EngineConfig(model=str(model), device="cpu", dtype="bfloat16", block_size=16, max_model_len=128,
                       max_num_seqs=4).resolve()
    runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    runner.allocate_kv_cache(12)
    prompts = [synthetic_prompt(n, seed=n) for n in (9, 5, 3)]
    blocks = [[0], [4], [8]]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), 0.0, None, i32(b), 0, len(p))
                                       for i, (p, b) in enumerate(zip(prompts, blocks))])]
    plans += [StepPlan(s, decode_seq_ids=i32([0, 1, 2])) for s in range(1, 4)]
    logits: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        logits.append(compute_logits(hidden))
        return logits[-1]

    calls = count_gemv_calls(monkeypatch)
    monkeypatch.setattr(runner.model, "compute_logits", recorded)
    with force_fused_kernels():
        tokens = [runner.finalize(runner.execute(plan)).tolist() for plan in plans]
    return tokens, logits, calls


@pytest.mark.parametrize("arch", ["qwen3", "llama-bias"])
def test_a_model_decodes_with_gemv_as_with_cublas(tiny_models: dict[str, Path], arch: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        tokens, logits, calls = run_model(tiny_models[arch], 16, mp)
    with pytest.MonkeyPatch.context() as mp:
        ref_tokens, ref_logits, ref_calls = run_model(tiny_models[arch], 0, mp)

    # Every decode step: qkv, o, gate_up and down of both layers, then the LM head; the prefill's LM head (3 rows).
    assert len(calls) == 1 + 3 * (4 * 2 + 1) and ref_calls == []
    assert all(shape[0] == 3 for shape in calls)
    assert tokens == ref_tokens
    for out, ref in zip(logits, ref_logits):
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def run_one_sequence(model: Path, fused: bool, monkeypatch: pytest.MonkeyPatch
                     ) -> tuple[list[list[int]], list[torch.Tensor], list[str]]:
    """Prefill one 9-token prompt, then decode it for 3 steps (batch 1) through a CPU ModelRunner in bfloat16, with
    the fused kernels forced on (`fused`) or the plain CPU path. Returns (tokens per step, logits per step, the
    name of every GEMV kernel function called)."""
    from common.config import EngineConfig
    from common.protocol import NewRequest, StepPlan, i32
    from tests.conftest import synthetic_prompt
    from workers.layers.fused import force_fused_kernels
    from workers.model_runner import ModelRunner

    monkeypatch.setenv("DELTASERVE_GEMV_MAX_BATCH", "1")
    cfg = EngineConfig(model=str(model), device="cpu", dtype="bfloat16", block_size=16, max_model_len=128,
                       max_num_seqs=4).resolve()
    runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    runner.allocate_kv_cache(4)
    prompt = synthetic_prompt(9, seed=9)
    plans = [StepPlan(0, new_requests=[NewRequest(0, i32(prompt), 0.0, None, i32([0]), 0, len(prompt))])]
    plans += [StepPlan(s, decode_seq_ids=i32([0])) for s in range(1, 4)]
    logits: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        logits.append(compute_logits(hidden))
        return logits[-1]

    calls: list[str] = []

    def counted(name: str) -> object:
        kernel = getattr(gemv_module, name)

        def call(*args: object, **kwargs: object) -> object:
            calls.append(name)
            return kernel(*args, **kwargs)
        return call

    for name in ("gemv", "silu_and_mul_gemv", "add_rms_norm_gemv"):
        monkeypatch.setattr(gemv_module, name, counted(name))
    monkeypatch.setattr(runner.model, "compute_logits", recorded)
    with force_fused_kernels() if fused else contextlib.nullcontext():
        tokens = [runner.finalize(runner.execute(plan)).tolist() for plan in plans]
    return tokens, logits, calls


@pytest.mark.parametrize("arch", ["qwen3", "llama-bias"])
def test_a_decode_step_of_one_sequence_runs_the_norms_and_silu_inside_the_gemvs(tiny_models: dict[str, Path],
                                                                                 arch: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        tokens, logits, calls = run_one_sequence(tiny_models[arch], True, mp)
    with pytest.MonkeyPatch.context() as mp:
        ref_tokens, ref_logits, ref_calls = run_one_sequence(tiny_models[arch], False, mp)

    # Each decode step, each of the 2 layers: norm+qkv, o, norm+gate_up, silu+down; then the LM head. The prefill
    # (9 rows) runs the unfused layers with cuBLAS, and its LM head (1 row) the GEMV.
    layer = ["add_rms_norm_gemv", "gemv", "add_rms_norm_gemv", "silu_and_mul_gemv"]
    assert calls == ["gemv"] + 3 * (2 * layer + ["gemv"]) and ref_calls == []
    assert tokens == ref_tokens
    for out, ref in zip(logits, ref_logits):
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
