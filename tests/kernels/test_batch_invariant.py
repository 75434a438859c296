"""The batch-invariant kernels (gpu_kernels/batch_invariant.py): one row gives the same bits alone and inside any
batch, and those bits are the exact float64 result up to float32 summation and the final roundings.

"Invariant" is checked the strict way: a batch of M fresh random rows is computed once, every row of it alone
(M = 1), and each row of the batch must be `torch.equal` to its computation alone, so every position in the batch
and every chunk position of the CPU paths is covered, among random neighbours. Batch sizes 1, 3, 17 and 64 (the
issue's), and 2, 4, 18, 65 (that many neighbours plus the row).

A changed summation order moves a float32 sum by a unit in its last place, which survives in a float32 output but
moves a bfloat16 output only near a rounding tie (about 1 element in 30,000): the fp32 cases are the sensitive
ones, the bf16 cases check the 16-bit paths at all.

The Triton kernels run under the interpreter on CPU when there is no GPU (tests/kernels/conftest.py), on small
shapes and with small tiles so that several tiles, a strided persistent grid and K and N tails are exercised;
the CPU torch paths run at Qwen3 shapes. The tests marked `gpu` run both kernels compiled at Qwen3-0.6B's shapes
(`pytest -m gpu tests/kernels/test_batch_invariant.py`; scripts/gpu_tests.sh runs them).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from common import envs  # noqa: E402
from common.envs import parse_matmul_tile  # noqa: E402
from gpu_kernels.batch_invariant import (  # noqa: E402
    CPU_CHUNK_ROWS,
    HOPPER_CONFIGS,
    MatmulConfig,
    chunked_linear,
    chunked_rms_norm,
    hopper_config,
    matmul_batch_invariant,
    persistent_matmul,
    rms_norm_batch_invariant,
    rms_norm_rows,
    silu_and_mul_rows,
    with_small_tile,
)
from tests.kernels.hopper_compile import run_compile_script  # noqa: E402

BATCH_SIZES = [1, 2, 3, 4, 17, 18, 64, 65]
EPS = 1e-6
# Precision in bits (with the implicit one) of each dtype: rounding to nearest moves a value by at most
# |value| * 2^-bits.
PRECISION_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
FLOAT32_UNIT = 2.0**-24
# Small tiles for the interpreter: N and K below are not multiples of them, M = 65 spans five row tiles, three
# programs take the tiles in turns, and K splits every 32 features (K = 40: a split of 32 and one of 8). With three
# programs a batch of one row tile (M <= 16) computes its splits side by side, a larger one in one program each.
SMALL_TILES = MatmulConfig(block_m=16, block_n=16, block_k=16, k_split=32, group_m=2, num_warps=4, num_stages=2)


def random_inputs(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    return x, weight, bias


def assert_each_row_as_alone(batched: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """`batched(x)[i]` is bitwise `batched(x[i:i+1])[0]` for every row i."""
    together = batched(x)
    for i in range(x.shape[0]):
        alone = batched(x[i:i + 1])[0]
        assert torch.equal(together[i], alone), (
            f"row {i} of {x.shape[0]}: {int((together[i] != alone).sum())} elements differ from the row alone")


def assert_float32_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                           ) -> None:
    """y is the float64 `x @ W.T + bias` up to float32 summation and one rounding to y's dtype.

    Any order of summing K products and a bias in float32 is off by at most (K + 1) * 2^-24 times the sum of their
    magnitudes (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, eq. 4.4); float32 products of
    float32 inputs add one more 2^-24 each (16-bit inputs multiply exactly). Rounding to y's dtype adds
    |value| * 2^-bits. A worst-case bound, not a statistical one: no seed can fail it.
    """
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0]) and y.is_contiguous()
    ref = x.double() @ weight.double().T
    magnitudes = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        ref += bias.double()
        magnitudes += bias.double().abs()
    steps = x.shape[1] + 1 + (1 if x.dtype == torch.float32 else 0)
    rounding = 2.0 ** -PRECISION_BITS[y.dtype]
    tolerance = (ref.abs() + steps * FLOAT32_UNIT * magnitudes) * rounding + steps * FLOAT32_UNIT * magnitudes
    error = (y.double() - ref).abs()
    worst = int((error - tolerance).argmax())
    assert (error <= tolerance).all(), (f"y {y.flatten()[worst].item()} vs {ref.flatten()[worst].item()} "
                                        f"(tolerance {tolerance.flatten()[worst].item():.3g})")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * h / sqrt(mean(h^2) + eps) in float64, h) with h = x + residual rounded to x's dtype, as norm.py."""
    h = x + residual if residual is not None else x
    h64 = h.double()
    return weight.double() * h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + EPS), h


def assert_rms_norm_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          residual: torch.Tensor | None) -> None:
    """out is the float64 RMSNorm up to a float32 mean square and rsqrt and the two roundings to x's dtype.

    The mean of H squares is off by at most (H + 1) * 2^-24 of itself (all terms are positive: Higham eq. 4.4),
    its reciprocal square root by half that plus the rsqrt's own error (at most 2 ulp, 2^-22, on a GPU's
    rsqrt.approx); each of the two roundings to x's dtype adds 2^-bits. Relative to each element, worst case.
    """
    ref, _ = rms_norm_reference(x, weight, residual)
    rounding = 2.0 ** -PRECISION_BITS[x.dtype]
    inv_rms_error = (x.shape[-1] + 1) * FLOAT32_UNIT / 2 + 2.0**-22
    tolerance = ref.abs() * ((1 + rounding) ** 2 * (1 + inv_rms_error) - 1)
    error = (out.double() - ref).abs()
    assert out.dtype == x.dtype and out.shape == x.shape
    assert (error <= tolerance).all(), f"largest error {(error - tolerance).max().item():.3g} over the tolerance"


# ================================================================ the persistent Triton matmul (interpreter on CPU)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", BATCH_SIZES)
def test_persistent_matmul_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype, m: int) -> None:
    """N = 24 and K = 40 are multiples of no tile; the row alone is 2 tiles, a batch up to 5 x 2."""
    x, weight, bias = random_inputs(m, 24, 40, dtype, with_bias=True, seed=m)

    assert_each_row_as_alone(lambda rows: persistent_matmul(rows, weight, bias, config=SMALL_TILES,
                                                            num_programs=3), x)


@pytest.mark.parametrize("m", [1, 17, 65])
def test_persistent_matmul_with_the_hopper_configuration_gives_a_row_the_same_bits_in_any_batch(m: int) -> None:
    x, weight, bias = random_inputs(m, 200, 100, torch.bfloat16, with_bias=False, seed=100 + m)

    assert_each_row_as_alone(lambda rows: persistent_matmul(rows, weight, bias), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 70), (17, 33, 64), (65, 16, 200)])
def test_persistent_matmul_is_the_rounded_float32_product(dtype: torch.dtype, with_bias: bool, m: int, n: int,
                                                          k: int) -> None:
    x, weight, bias = random_inputs(m, n, k, dtype, with_bias, seed=m * n + k)

    assert_float32_product(persistent_matmul(x, weight, bias, config=SMALL_TILES, num_programs=3), x, weight, bias)


def test_persistent_matmul_with_the_hopper_configuration_is_the_rounded_float32_product() -> None:
    x, weight, bias = random_inputs(130, 150, 100, torch.bfloat16, with_bias=True, seed=5)

    assert_float32_product(persistent_matmul(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("m", "k"), [(1, 40), (3, 96), (17, 200), (65, 33)])
def test_persistent_matmul_gives_the_same_bits_with_its_splits_side_by_side_or_in_one_program(
        dtype: torch.dtype, m: int, k: int) -> None:
    """The two ways to run K's splits add the same split sums in the same order: bitwise equal, bias included (K =
    33: one split and a tail of one feature; 96: three whole splits)."""
    x, weight, bias = random_inputs(m, 24, k, dtype, with_bias=True, seed=7 * m + k)

    side_by_side = persistent_matmul(x, weight, bias, config=SMALL_TILES, num_programs=3, split_out=True)
    in_one = persistent_matmul(x, weight, bias, config=SMALL_TILES, num_programs=3, split_out=False)

    assert torch.equal(side_by_side, in_one)
    assert_float32_product(side_by_side, x, weight, bias)


def test_persistent_matmul_with_the_hopper_configuration_splits_k_the_same_way_at_any_m() -> None:
    """K = 600 is a split of 512 and a tail of 88: a row alone takes the 16-row tile and runs the splits side by
    side (4 tiles for 132 programs), a batch of 130 rows the 128-row tile and the splits within a program (2
    programs): the same bits."""
    x, weight, _ = random_inputs(130, 200, 600, torch.bfloat16, with_bias=False, seed=11)

    together = persistent_matmul(x, weight, num_programs=2)
    for i in (0, 64, 129):
        assert torch.equal(together[i], persistent_matmul(x[i:i + 1], weight)[0]), f"row {i}"
    assert_float32_product(together, x, weight, None)


def test_persistent_matmul_reads_any_strides() -> None:
    """x a column slice of a wider tensor, the weight transposed in memory: the same bits as contiguous copies."""
    wide, weight, bias = random_inputs(20, 24, 90, torch.bfloat16, with_bias=True, seed=9)
    x = wide[:, 10:80]
    weight_t = weight[:, 10:80].T.contiguous().T

    y = persistent_matmul(x, weight_t, bias, config=SMALL_TILES)

    assert torch.equal(y, persistent_matmul(x.contiguous(), weight_t.contiguous(), bias, config=SMALL_TILES))
    assert_float32_product(y, x, weight_t, bias)


# ================================================================================ the CPU path of the matmul
# Qwen3-0.6B-like shapes (K = 1024, N = 3072: its gate_up's half) and a smaller model's (K = 576, N = 1728).
CPU_SHAPES = [(1728, 576), (3072, 1024)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), CPU_SHAPES, ids=[f"{n}x{k}" for n, k in CPU_SHAPES])
def test_chunked_linear_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype, n: int, k: int) -> None:
    """Over all batch sizes a row sits at every one of the 16 chunk positions, in a full chunk and in the padded
    last one, among random neighbours."""
    _, weight, bias = random_inputs(0, n, k, dtype, with_bias=True, seed=n)
    for m in BATCH_SIZES:
        x, _, _ = random_inputs(m, 1, k, dtype, with_bias=False, seed=n + m)
        assert_each_row_as_alone(lambda rows: chunked_linear(rows, weight, bias), x)


def test_chunked_linear_gives_a_row_the_same_bits_in_any_batch_on_two_threads() -> None:
    """With two threads MKL may split one call's work over them; it does so alike for every chunk."""
    x, weight, bias = random_inputs(40, 3072, 1024, torch.float32, with_bias=False, seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_each_row_as_alone(lambda rows: chunked_linear(rows, weight, bias), x)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), CPU_SHAPES, ids=[f"{n}x{k}" for n, k in CPU_SHAPES])
def test_chunked_linear_is_the_rounded_float32_product(dtype: torch.dtype, n: int, k: int) -> None:
    x, weight, bias = random_inputs(CPU_CHUNK_ROWS + 5, n, k, dtype, with_bias=True, seed=k)

    assert_float32_product(chunked_linear(x, weight, bias), x, weight, bias)


def test_chunked_linear_takes_a_non_contiguous_x() -> None:
    wide, _, _ = random_inputs(20, 1, 300, torch.float32, with_bias=False, seed=4)
    _, weight, bias = random_inputs(0, 64, 100, torch.float32, with_bias=True, seed=5)
    x = wide[:, ::3]

    assert torch.equal(chunked_linear(x, weight, bias), chunked_linear(x.contiguous(), weight, bias))


def test_matmul_batch_invariant_on_cpu_tensors_is_the_chunked_path() -> None:
    x, weight, bias = random_inputs(19, 48, 64, torch.float32, with_bias=True, seed=1)

    assert torch.equal(matmul_batch_invariant(x, weight, bias), chunked_linear(x, weight, bias))


# ======================================================================================== edge cases, errors
MATMULS = {"triton": lambda x, w, b: persistent_matmul(x, w, b, config=SMALL_TILES), "cpu": chunked_linear,
           "dispatch": matmul_batch_invariant}


@pytest.mark.parametrize("matmul", MATMULS.values(), ids=MATMULS.keys())
def test_matmul_of_an_empty_batch_is_empty(matmul: Callable) -> None:
    _, weight, bias = random_inputs(0, 24, 32, torch.bfloat16, with_bias=True, seed=0)

    y = matmul(torch.empty(0, 32, dtype=torch.bfloat16), weight, bias)

    assert y.shape == (0, 24) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("matmul", MATMULS.values(), ids=MATMULS.keys())
def test_matmul_without_input_features_is_the_bias(matmul: Callable) -> None:
    bias = torch.randn(5)

    assert torch.equal(matmul(torch.empty(3, 0), torch.empty(5, 0), bias), bias.expand(3, 5))
    assert torch.equal(matmul(torch.empty(3, 0), torch.empty(5, 0), None), torch.zeros(3, 5))


BAD_MATMUL_INPUTS = [
    ((torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8), None), "weight dtype torch.float32 must equal"),
    ((torch.randn(4, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64), None),
     "x dtype torch.float64 must be one of"),
    ((torch.randn(2, 4, 8), torch.randn(6, 8), None), r"needs x \[M, K\] and weight \[N, K\], got x \(2, 4, 8\)"),
    ((torch.randn(8), torch.randn(6, 8), None), r"got x \(8,\)"),
    ((torch.randn(4, 8), torch.randn(6, 7), None), r"x has 8 input features \(K\) but weight \(6, 7\) has 7"),
    ((torch.randn(4, 8), torch.randn(6, 8), torch.randn(5)), r"bias torch.float32 \(5,\) on cpu must be"),
    ((torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, dtype=torch.bfloat16)), "bias torch.bfloat16"),
]


@pytest.mark.parametrize("matmul", MATMULS.values(), ids=MATMULS.keys())
@pytest.mark.parametrize(("args", "message"), BAD_MATMUL_INPUTS,
                         ids=["dtype-mismatch", "float64", "3-d", "1-d", "k-mismatch", "bias-shape", "bias-dtype"])
def test_matmul_refuses_bad_inputs_naming_the_problem(matmul: Callable, args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        matmul(*args)


def test_matmul_config_refuses_a_block_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 48"):
        MatmulConfig(block_m=64, block_n=64, block_k=48)


def test_matmul_config_refuses_a_k_split_that_cuts_a_k_tile() -> None:
    with pytest.raises(ValueError, match=r"k_split must be a multiple of block_k \(64\), got 96"):
        MatmulConfig(block_m=64, block_n=64, block_k=64, k_split=96)


def test_matmul_config_refuses_fewer_than_one_program_per_sm() -> None:
    with pytest.raises(ValueError, match="programs_per_sm must be >= 1, got 0"):
        MatmulConfig(block_m=16, block_n=64, block_k=64, programs_per_sm=0)


def test_persistent_matmul_gives_the_same_bits_with_more_programs_per_sm() -> None:
    """More programs only deal the work items out differently: a row of one batch and the batch are the bits of
    one program per SM."""
    x, weight, bias = random_inputs(5, 40, 96, torch.float32, with_bias=True, seed=3)
    wide = dataclasses.replace(SMALL_TILES, programs_per_sm=3)

    assert torch.equal(persistent_matmul(x, weight, bias, config=wide, split_out=True),
                       persistent_matmul(x, weight, bias, config=SMALL_TILES, num_programs=2, split_out=True))


def test_the_small_tile_override_sets_only_the_few_row_configuration_s_tile() -> None:
    assert parse_matmul_tile(" block_n=32, num_warps = 2,programs_per_sm=4 ,") == {
        "block_n": 32, "num_warps": 2, "programs_per_sm": 4}
    assert parse_matmul_tile("") == {}
    changed = with_small_tile(HOPPER_CONFIGS, {"block_n": 32, "programs_per_sm": 4})
    for dtype, family in changed.items():
        first = family[0][1]
        assert (first.block_n, first.programs_per_sm) == (32, 4)
        assert (first.block_k, first.k_split) == (HOPPER_CONFIGS[dtype][0][1].block_k,
                                                  HOPPER_CONFIGS[dtype][0][1].k_split)
        assert family[1:] == HOPPER_CONFIGS[dtype][1:]
    assert with_small_tile(HOPPER_CONFIGS, {}) is HOPPER_CONFIGS


@pytest.mark.parametrize("text", ["k_split=256", "block_k=128", "block_n", "warps=4", "=16", "BLOCK_N=16"])
def test_the_small_tile_override_refuses_anything_but_tile_fields(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """block_k and k_split fix a row's arithmetic: they cannot be set for few rows alone; the launcher's check of
    every variable refuses the setting before anything starts."""
    monkeypatch.setenv("DELTASERVE_MATMUL_SMALL_TILE", text)
    with pytest.raises(ValueError, match="DELTASERVE_MATMUL_SMALL_TILE: .* is not key=value with a key among "
                                         "block_m"):
        envs.check_all()


@pytest.mark.parametrize(("text", "message"), [
    ("block_m=0", "block_m must be a power of two from 16 to 256, got '0'"),
    ("block_n=24", "block_n must be a power of two from 16 to 256, got '24'"),
    ("block_n=-16", "block_n must be a power of two from 16 to 256, got '-16'"),
    ("block_n=wide", "block_n must be a power of two from 16 to 256, got 'wide'"),
    ("block_m=99999999999999999999", "block_m must be a power of two from 16 to 256, got '9999"),
    ("num_warps=3", "num_warps must be a power of two from 1 to 16, got '3'"),
    ("num_stages=0", "num_stages must be a whole number from 1 to 8, got '0'"),
    ("programs_per_sm=0", "programs_per_sm must be a whole number from 1 to 16, got '0'"),
    ("block_m=16,block_m=32", "block_m is given twice"),
])
def test_the_small_tile_override_refuses_a_value_out_of_range_before_start(
        text: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a fresh user: block_m=0 passed the launcher and then stopped the worker with a traceback."""
    monkeypatch.setenv("DELTASERVE_MATMUL_SMALL_TILE", text)
    with pytest.raises(ValueError, match=f"^DELTASERVE_MATMUL_SMALL_TILE: {re.escape(message)}"):
        envs.check_all()


def test_a_small_tile_override_with_a_bad_value_is_refused_by_the_configuration() -> None:
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        with_small_tile(HOPPER_CONFIGS, {"block_n": 24})


def test_every_dtype_s_hopper_configurations_share_their_k_step_and_split_and_cover_every_m() -> None:
    assert set(HOPPER_CONFIGS) == {torch.bfloat16, torch.float16, torch.float32}
    for dtype, family in HOPPER_CONFIGS.items():
        assert len({(config.block_k, config.k_split) for _, config in family}) == 1, dtype
        bounds = [max_m for max_m, _ in family]
        assert bounds == sorted(bounds) and bounds[-1] >= 1 << 31
        assert hopper_config(dtype, 1) is family[0][1] and hopper_config(dtype, 1 << 20) is family[-1][1]


# ============================================================================================ RMSNorm
NORMS = {"triton": rms_norm_rows, "cpu": chunked_rms_norm, "dispatch": rms_norm_batch_invariant}


def norm_inputs(m: int, hidden: int, dtype: torch.dtype, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, hidden, generator=generator) * 3).to(dtype)
    residual = torch.randn(m, hidden, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_rms_norm_rows_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype, with_residual: bool) -> None:
    """hidden = 200 with block 128: two slices, the second part-masked. One program per row, so the issue's batch
    sizes suffice."""
    _, _, weight = norm_inputs(0, 200, dtype, seed=0)

    def norm(rows: torch.Tensor) -> torch.Tensor:  # rows: [x | residual]
        if not with_residual:
            return rms_norm_rows(rows[:, :200], weight, EPS, block=128)
        return torch.cat(rms_norm_rows(rows[:, :200], weight, EPS, rows[:, 200:], block=128), dim=1)

    for m in [1, 3, 17, 64]:
        x, residual, _ = norm_inputs(m, 200, dtype, seed=m)
        assert_each_row_as_alone(norm, torch.cat([x, residual], dim=1))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100) in float32 is inf, as on the GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_silu_and_mul_rows_gives_a_row_the_same_bits_in_any_batch_and_eager_torch_s_roundings(
        dtype: torch.dtype) -> None:
    """1,100 features: a tail past the 1,024-wide block; saturated exp at |gate| = 100 (silu(-100) = -0)."""
    gen = torch.Generator().manual_seed(5)
    batch = (torch.randn(17, 2 * 1100, generator=gen) * 4).to(dtype)
    batch[3, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = silu_and_mul_rows(batch)
    assert out.shape == (17, 1100) and out.dtype == dtype
    for row in range(17):
        assert torch.equal(silu_and_mul_rows(batch[row: row + 1])[0], out[row]), row
    gate, up = batch.float().chunk(2, dim=-1)
    silu = (gate / (1 + torch.exp(-gate))).to(dtype).float()
    expected = (silu * up).to(dtype)
    # numpy's float32 exp (the interpreter) and torch's may differ in the last float32 bit: often visible in a
    # float32 output, rarely a bfloat16 rounding apart
    if dtype == torch.bfloat16:
        assert torch.isclose(out.float(), expected.float(), rtol=2 ** -7, atol=0).all()
        assert (out != expected).sum() <= out.numel() // 100
    else:
        assert torch.allclose(out, expected, rtol=1e-6, atol=0)
    assert silu_and_mul_rows(batch[:0]).shape == (0, 1100)
    with pytest.raises(ValueError, match=r"silu_and_mul_rows needs x \[\.\.\., 2 \* I\]"):
        silu_and_mul_rows(batch[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [576, 1024])
def test_chunked_rms_norm_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype, hidden: int) -> None:
    _, _, weight = norm_inputs(0, hidden, dtype, seed=0)

    def add_norm(rows: torch.Tensor) -> torch.Tensor:  # rows: [x | residual]
        return torch.cat(chunked_rms_norm(rows[:, :hidden], weight, EPS, rows[:, hidden:]), dim=1)

    for m in BATCH_SIZES:
        x, residual, _ = norm_inputs(m, hidden, dtype, seed=m)
        assert_each_row_as_alone(lambda rows: chunked_rms_norm(rows, weight, EPS), x)
        assert_each_row_as_alone(add_norm, torch.cat([x, residual], dim=1))


def test_chunked_rms_norm_gives_a_row_the_same_bits_where_torch_splits_a_row_over_threads() -> None:
    """At 2 threads torch sums a row of 65,536 float32 features in two halves when it has few rows, in one pass
    when it has many (measured on torch 2.13: row 0 of `pow(2).mean(-1)` differs at M = 1 and M = 64); the chunks
    give the reduction one shape."""
    x, _, weight = norm_inputs(17, 65536, torch.float32, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_each_row_as_alone(lambda rows: chunked_rms_norm(rows, weight, EPS), x)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_rms_norm_is_the_float64_norm_up_to_its_roundings(norm: Callable, dtype: torch.dtype,
                                                           with_residual: bool) -> None:
    x, residual, weight = norm_inputs(19, 1000, dtype, seed=7)

    result = norm(x, weight, EPS, residual if with_residual else None)

    out = result[0] if with_residual else result
    assert_rms_norm_close(out, x, weight, residual if with_residual else None)
    if with_residual:  # h = x + residual rounded to x's dtype, exactly
        assert torch.equal(result[1], x + residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_rms_norm_gives_the_bits_of_the_norm_layer(dtype: torch.dtype) -> None:
    """On a CPU at a realistic hidden size the deterministic path changes nothing: workers/layers/norm.py's bits."""
    from workers.layers.norm import add_rms_norm, rms_norm

    x, residual, weight = norm_inputs(40, 1024, dtype, seed=11)

    assert torch.equal(chunked_rms_norm(x, weight, EPS), rms_norm(x, weight, EPS))
    normed, h = chunked_rms_norm(x, weight, EPS, residual)
    expected_normed, expected_h = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(normed, expected_normed) and torch.equal(h, expected_h)


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
def test_rms_norm_takes_leading_dimensions_and_leaves_its_inputs_alone(norm: Callable) -> None:
    """QK-norm's layout, [tokens, heads, head_dim]: each head vector normalised on its own."""
    x, residual, weight = norm_inputs(12, 16, torch.bfloat16, seed=5)
    x3, residual3 = x.reshape(3, 4, 16), residual.reshape(3, 4, 16)
    x_before, residual_before = x3.clone(), residual3.clone()

    out, h = norm(x3, weight, EPS, residual3)

    expected_out, expected_h = norm(x, weight, EPS, residual)
    assert torch.equal(out, expected_out.reshape(3, 4, 16)) and torch.equal(h, expected_h.reshape(3, 4, 16))
    assert torch.equal(x3, x_before) and torch.equal(residual3, residual_before)


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
def test_rms_norm_of_an_empty_batch_is_empty(norm: Callable) -> None:
    weight = torch.ones(32, dtype=torch.bfloat16)
    empty = torch.empty(0, 32, dtype=torch.bfloat16)

    assert norm(empty, weight, EPS).shape == (0, 32)
    out, h = norm(empty, weight, EPS, empty)
    assert out.shape == h.shape == (0, 32)


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
def test_rms_norm_of_one_feature_is_its_sign_times_the_weight(norm: Callable) -> None:
    x = torch.tensor([[2.0], [-0.5]])

    assert torch.allclose(norm(x, torch.tensor([3.0]), EPS), torch.tensor([[3.0], [-3.0]]), rtol=1e-5)


BAD_NORM_INPUTS = [
    ((torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(8), None), r"weight torch.float32 \(8,\) on cpu must be "
                                                                        r"torch.bfloat16 \(8,\)"),
    ((torch.randn(4, 8), torch.ones(7), None), r"weight torch.float32 \(7,\) on cpu must be torch.float32 \(8,\)"),
    ((torch.randn(4, 8), torch.ones(8), torch.randn(4, 7)), r"residual torch.float32 \(4, 7\) on cpu must be"),
    ((torch.randn(4, 8), torch.ones(8), torch.randn(4, 8, dtype=torch.bfloat16)), "residual torch.bfloat16"),
    ((torch.tensor(1.0), torch.ones(1), None), r"needs x \[..., hidden\] with hidden >= 1, got \(\)"),
    ((torch.randn(4, 0), torch.ones(0), None), r"with hidden >= 1, got \(4, 0\)"),
    ((torch.randn(4, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), None), "x dtype torch.float64"),
]


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
@pytest.mark.parametrize(("args", "message"), BAD_NORM_INPUTS,
                         ids=["weight-dtype", "weight-shape", "residual-shape", "residual-dtype", "0-d", "hidden-0",
                              "float64"])
def test_rms_norm_refuses_bad_inputs_naming_the_problem(norm: Callable, args: tuple, message: str) -> None:
    x, weight, residual = args
    with pytest.raises(ValueError, match=message):
        norm(x, weight, EPS, residual)


# =========================================================================================== compiled for sm90
# A fresh process compiles the kernels for Hopper (no GPU needed: Triton ships ptxas), since in this one they are
# interpreted; M is an i32 argument like any other, never a constant of the compiled kernel.
HOPPER_COMPILE = r"""
import json, re
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import gpu_kernels.batch_invariant as b

def compiled(fn, signature, constexprs, num_warps, num_stages=3, aligned=()):
    # aligned: the arguments Triton sees as multiples of 16 when called on Qwen3's shapes (never M, which is
    # not specialized).
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    ops = ("wgmma.mma_async", "mma.sync", "cp.async", "div.rn.f32", "rsqrt.approx")
    return {"shared": kernel.metadata.shared, **{op: len(re.findall(re.escape(op), ptx)) for op in ops}}

def matmul(dtype, ty, config, split_out):
    signature = {"x_ptr": ty, "w_ptr": ty, "bias_ptr": ty, "y_ptr": ty, "partial_ptr": "*fp32",
                 "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
                 "stride_ym": "i32"}
    constexprs = {"stride_xk": 1, "stride_wk": 1, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                  "BLOCK_K": config.block_k, "K_SPLIT": config.k_split, "GROUP_M": config.group_m, "HAS_BIAS": True,
                  "EVEN_K": True, "IEEE_DOT": dtype == torch.float32, "INTERPRETED": False,
                  "SPLIT_OUT": split_out, "PDL": True}
    aligned = ("x_ptr", "w_ptr", "bias_ptr", "y_ptr", "partial_ptr", "N", "K", "stride_xm", "stride_wn",
               "stride_ym")
    return compiled(b._persistent_matmul_kernel, signature, constexprs, config.num_warps, config.num_stages, aligned)

norm_signature = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "h_ptr": "*bf16",
                  "H": "i32", "stride_x": "i32", "stride_res": "i32", "eps": "fp32"}
ops = {"norm": compiled(b._rms_norm_kernel, norm_signature, {"BLOCK": 1024, "HAS_RESIDUAL": True, "PDL": True}, 4)}
for dtype, ty, name in ((torch.bfloat16, "*bf16", "bf16"), (torch.float32, "*fp32", "fp32")):
    for max_m, config in b.HOPPER_CONFIGS[dtype]:
        for split_out in (False, True):
            ops[f"{name}-m{config.block_m}{'-split-out' if split_out else ''}"] = matmul(dtype, ty, config, split_out)
print(json.dumps(ops))
"""
HOPPER_SHARED_MEMORY_BYTES = 227 * 1024  # the most one block may take on an H100 or H200


def test_the_kernels_compile_for_hopper_with_tensor_cores_for_16_bit_inputs() -> None:
    pytest.importorskip("triton.backends.nvidia")
    ops = run_compile_script(HOPPER_COMPILE)

    # bf16: tensor cores (wgmma from 64-row tiles, mma.sync for the 16-row one) fed by cp.async copies (Triton's
    # software pipeline), whether a program adds its splits (the branch at each split's end inside the K loop) or
    # writes one split out; fp32: IEEE products, no tensor cores.
    matmuls = {name: counts for name, counts in ops.items() if name != "norm"}
    assert len(matmuls) == 12
    for name, counts in matmuls.items():
        tensor_core_ops = counts["wgmma.mma_async"] + counts["mma.sync"]
        assert tensor_core_ops > 0 if name.startswith("bf16") else tensor_core_ops == 0, name
        assert counts["cp.async"] > 0, name
        assert counts["shared"] <= HOPPER_SHARED_MEMORY_BYTES, name
    assert ops["bf16-m128"]["wgmma.mma_async"] > 0 and ops["bf16-m16"]["mma.sync"] > 0
    # The norm's mean square divided as torch divides (rounded to nearest), then the hardware's rsqrt.
    assert ops["norm"]["div.rn.f32"] == 1 and ops["norm"]["rsqrt.approx"] == 1


# ======================================================================================== on a GPU, real sizes
# Qwen3-0.6B's linear layers (N, K): o, qkv, gate_up, LM head (K = 1024), and down.
GPU_SHAPES = [(1024, 1024), (3072, 1024), (6144, 1024), (151936, 1024), (1024, 3072)]
GPU_BATCH_SIZES = [1, 7, 64, 256, 1000]


GPU_CASES = [(torch.bfloat16, n, k) for n, k in GPU_SHAPES] + [(torch.float32, 3072, 1024), (torch.float32, 1024, 3072)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "n", "k"), GPU_CASES,
                         ids=[f"{str(d)[6:]}-{n}x{k}" for d, n, k in GPU_CASES])
def test_matmul_on_a_gpu_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype, n: int, k: int) -> None:
    """Qwen3-0.6B's shapes in bf16 (tensor cores), two in fp32 (whose output shows a changed summation order
    in most elements, where bf16's rounding hides it in most): 1000 rows each computed alone; batches of 1, 7, 64,
    256 and 1000 of them in random order must give each row those bits. cuBLAS (F.linear) is computed too, and
    the number of its rows that differ from their computation alone is printed, not asserted."""
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    pool = torch.randn(max(GPU_BATCH_SIZES), k, device="cuda", generator=generator).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=generator) * k**-0.5).to(dtype)
    alone = torch.cat([matmul_batch_invariant(pool[i:i + 1], weight) for i in range(pool.shape[0])])
    assert_float32_product(alone[:64], pool[:64], weight, None)
    cublas_alone = torch.cat([F.linear(pool[i:i + 1], weight) for i in range(pool.shape[0])])
    for m in GPU_BATCH_SIZES:
        order = torch.randperm(pool.shape[0], device="cuda", generator=generator)[:m]
        y = matmul_batch_invariant(pool[order], weight)
        differing = (y != alone[order]).any(dim=1)
        assert not differing.any(), f"M={m}: {int(differing.sum())} rows differ from the row alone"
        cublas_differing = int((F.linear(pool[order], weight) != cublas_alone[order]).any(dim=1).sum())
        print(f"{dtype} {n}x{k} M={m}: cuBLAS rows differing from alone: {cublas_differing} of {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "n", "k"), GPU_CASES,
                         ids=[f"{str(d)[6:]}-{n}x{k}" for d, n, k in GPU_CASES])
def test_every_tile_of_a_dtype_s_configurations_gives_the_same_bits(dtype: torch.dtype, n: int, k: int) -> None:
    """What `HOPPER_CONFIGS` rests on: its configurations differ only in their tiles (and warps, stages), which
    must not change an element's arithmetic. 300 rows by each configuration, splits side by side and within a
    program: bitwise equal."""
    generator = torch.Generator(device="cuda").manual_seed(3 * n + k)
    x = torch.randn(300, k, device="cuda", generator=generator).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=generator) * k**-0.5).to(dtype)
    results = {(config.block_m, split_out): persistent_matmul(x, weight, config=config, split_out=split_out)
               for _, config in HOPPER_CONFIGS[dtype] for split_out in (False, True)}
    first = next(iter(results.values()))
    for key, y in results.items():
        assert torch.equal(y, first), f"tile rows, splits side by side {key}: {int((y != first).sum())} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hidden", [128, 1024])
def test_rms_norm_on_a_gpu_gives_a_row_the_same_bits_in_any_batch(hidden: int) -> None:
    """bf16, with and without the residual: Qwen3-0.6B's hidden size and its QK-norm's head_dim."""
    generator = torch.Generator(device="cuda").manual_seed(hidden)
    pool = (torch.randn(max(GPU_BATCH_SIZES), hidden, device="cuda", generator=generator) * 3).to(torch.bfloat16)
    residual = torch.randn(pool.shape, device="cuda", generator=generator).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=generator)).to(torch.bfloat16)
    alone = torch.cat([rms_norm_batch_invariant(pool[i:i + 1], weight, EPS) for i in range(pool.shape[0])])
    alone_res = [rms_norm_batch_invariant(pool[i:i + 1], weight, EPS, residual[i:i + 1])
                 for i in range(pool.shape[0])]
    alone_normed = torch.cat([normed for normed, _ in alone_res])
    assert_rms_norm_close(alone, pool, weight, None)
    assert_rms_norm_close(alone_normed, pool, weight, residual)
    for m in GPU_BATCH_SIZES:
        order = torch.randperm(pool.shape[0], device="cuda", generator=generator)[:m]
        assert torch.equal(rms_norm_batch_invariant(pool[order], weight, EPS), alone[order]), f"M={m}"
        normed, h = rms_norm_batch_invariant(pool[order], weight, EPS, residual[order])
        assert torch.equal(normed, alone_normed[order]) and torch.equal(h, pool[order] + residual[order]), f"M={m}"
