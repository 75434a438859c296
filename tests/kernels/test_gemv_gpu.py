"""gemv compiled for a real GPU, on the linear layers of Qwen3-0.6B and Qwen3-8B at decode batches 1..16.

Each result is the exact product up to float32 summation and one rounding (`assert_rounded_float32_sum`, the
bound of the CPU tests), the same bits on a second call and inside a CUDA graph, with no host synchronisation;
split-K in one launch gives the bits of the two-launch reduction; the fused prologues (SiLU-and-mul, residual add
+ RMSNorm) give the compiled layers' values, which the model runs unfused on the GPU.
Run with `pytest -m gpu tests/kernels/test_gemv_gpu.py` on a CUDA machine (scripts/gpu_tests.sh runs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("triton")

from gpu_kernels import split_counters  # noqa: E402
from gpu_kernels.gemv import add_rms_norm_gemv, choose_gemv_config, gemv, silu_and_mul_gemv  # noqa: E402

from .test_gemv import assert_rounded_float32_sum, ulps_apart  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (N, K): Qwen3-0.6B qkv, o, gate_up, down, LM head; Qwen3-8B qkv, o, gate_up, down.
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
          (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
BATCHES = [1, 2, 4, 8, 16]


def cuda_inputs(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=generator).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=generator) * k**-0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=generator).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gemv_at_real_shapes_is_the_rounded_float32_product_with_the_same_bits_every_call(n: int, k: int) -> None:
    for m in BATCHES:
        x, weight, bias = cuda_inputs(m, n, k, torch.bfloat16, with_bias=m == 3, seed=m)
        y = gemv(x, weight, bias)
        assert_rounded_float32_sum(y, x, weight, bias)
        assert torch.equal(gemv(x, weight, bias), y), f"M={m}: a second call gave other bits"


@pytest.mark.parametrize("m", [1, 5, 16])
def test_gemv_in_fp16_with_a_bias_at_the_8b_down_shape(m: int) -> None:
    x, weight, bias = cuda_inputs(m, 4096, 12288, torch.float16, with_bias=True, seed=m)
    assert_rounded_float32_sum(gemv(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_replays_in_a_cuda_graph_with_new_inputs_and_never_synchronises(m: int) -> None:
    n, k = 1024, 3072  # split over K: two kernels and a partials buffer inside the graph
    assert choose_gemv_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count).split_k > 1
    x, weight, bias = cuda_inputs(m, n, k, torch.bfloat16, with_bias=True, seed=0)
    gemv(x, weight, bias)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # an eager call that waited for the device would raise here
    try:
        gemv(x, weight, bias)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, weight, bias)
    for seed in (1, 2):
        x.copy_(cuda_inputs(m, n, k, torch.bfloat16, with_bias=False, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gemv(x, weight, bias))
        assert_rounded_float32_sum(y, x, weight, bias)


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_one_launch_split_k_gives_the_bits_of_the_two_launch_reduction(n: int, k: int) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in BATCHES:
        x, weight, bias = cuda_inputs(m, n, k, torch.bfloat16, with_bias=m == 2, seed=m)
        config = choose_gemv_config(m, n, k, num_sms)
        one = gemv(x, weight, bias, config=config)
        two = gemv(x, weight, bias, config=dataclasses.replace(config, one_launch=False))
        assert torch.equal(one, two), f"M={m} (split_k {config.split_k}): one launch gave other bits"
        for _ in range(3):  # the counters are back at 0 after each launch
            assert torch.equal(gemv(x, weight, bias, config=config), one)
    assert not split_counters._counters[torch.device("cuda", 0)].any()


@pytest.fixture
def compiled() -> Iterator[tuple[Callable, Callable]]:
    """workers/layers' silu_and_mul and add_rms_norm, compiled as the model runner runs them on a GPU."""
    from workers.layers.activation import silu_and_mul
    from workers.layers.fused import enable_compilation
    from workers.layers.norm import add_rms_norm

    enable_compilation(True)
    yield silu_and_mul, add_rms_norm
    enable_compilation(False)


# (N, K) of the GEMV after each prologue: Qwen3-0.6B, then Qwen3-8B.
SILU_SHAPES = [(1024, 3072), (4096, 12288)]  # down_proj
NORM_SHAPES = [(4096, 1024), (6144, 1024), (6144, 4096), (24576, 4096)]  # qkv_proj, gate_up_proj


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), SILU_SHAPES, ids=[f"{n}x{k}" for n, k in SILU_SHAPES])
def test_silu_and_mul_gemv_gives_the_compiled_layers_values(compiled: tuple[Callable, Callable],
                                                            dtype: torch.dtype, n: int, k: int) -> None:
    silu_and_mul, _ = compiled
    generator = torch.Generator(device="cuda").manual_seed(k)
    gate_up = (torch.randn(1, 2 * k, device="cuda", generator=generator) * 3).to(dtype)
    weight = cuda_inputs(1, n, k, dtype, with_bias=False, seed=1)[1]
    reference = silu_and_mul(gate_up)

    # Through an identity weight the output is the input features themselves.
    features = silu_and_mul_gemv(gate_up, torch.eye(k, device="cuda", dtype=dtype))
    apart = ulps_apart(features, reference)
    print(f"silu features differing from the compiled layer: {(apart > 0).sum().item()} of {k}")
    assert apart.max() <= 1 and (apart > 0).sum() <= k // 1000, "expected the compiled layer's bits"

    y = silu_and_mul_gemv(gate_up, weight)
    assert torch.equal(y, gemv(features, weight))
    assert_rounded_float32_sum(y, features, weight, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), NORM_SHAPES, ids=[f"{n}x{k}" for n, k in NORM_SHAPES])
def test_add_rms_norm_gemv_gives_the_compiled_layers_values(compiled: tuple[Callable, Callable],
                                                            dtype: torch.dtype, n: int, k: int) -> None:
    _, add_rms_norm = compiled
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    x, residual = (torch.randn(1, k, device="cuda", generator=generator).to(dtype) for _ in range(2))
    norm_weight = (torch.rand(k, device="cuda", generator=generator) + 0.5).to(dtype)
    weight, bias = cuda_inputs(1, n, k, dtype, with_bias=True, seed=2)[1:]
    reference, reference_h = add_rms_norm(x, residual, norm_weight, 1e-6)

    features, h = add_rms_norm_gemv(x, residual, norm_weight, 1e-6, torch.eye(k, device="cuda", dtype=dtype))
    assert torch.equal(h, reference_h)
    apart = ulps_apart(features, reference)
    # The mean square is summed in another order than inductor's: a feature may round the other way.
    print(f"norm features differing from the compiled layer: {(apart > 0).sum().item()} of {k}")
    assert apart.max() <= 1 and (apart > 0).sum() <= k // 50

    y, h = add_rms_norm_gemv(x, residual, norm_weight, 1e-6, weight, bias)
    assert torch.equal(h, reference_h)
    assert torch.equal(y, gemv(features, weight, bias))


def test_a_decoder_layers_fused_gemvs_replay_in_a_cuda_graph_with_new_inputs() -> None:
    """norm+qkv, o, norm+gate_up, silu+down at the Qwen3-0.6B shapes, all split over K, captured as one graph."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    hidden, inter, qkv = 1024, 3072, 4096
    for n, k in [(qkv, hidden), (hidden, 2048), (2 * inter, hidden), (hidden, inter)]:
        assert choose_gemv_config(1, n, k, num_sms).split_k > 1
    w_qkv, w_o, w_gate_up, w_down = (cuda_inputs(1, n, k, torch.bfloat16, False, seed=n + k)[1]
                                     for n, k in [(qkv, hidden), (hidden, 2048), (2 * inter, hidden), (hidden, inter)])
    norm_weight = torch.rand(hidden, device="cuda").bfloat16() + 0.5
    x, residual = torch.randn(1, hidden, device="cuda").bfloat16(), torch.randn(1, hidden, device="cuda").bfloat16()

    def layer() -> tuple[torch.Tensor, torch.Tensor]:
        q, h = add_rms_norm_gemv(x, residual, norm_weight, 1e-6, w_qkv)
        o = gemv(q[:, :2048], w_o)
        gate_up, h = add_rms_norm_gemv(o, h, norm_weight, 1e-6, w_gate_up)
        return silu_and_mul_gemv(gate_up, w_down), h

    layer()  # compile, and allocate the split-K counters, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_h = layer()
    for seed in (1, 2, 3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(1, hidden, device="cuda", generator=generator))
        residual.copy_(torch.randn(1, hidden, device="cuda", generator=generator))
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_h = layer()
        assert torch.equal(out, expected) and torch.equal(out_h, expected_h)
    assert not split_counters._counters[torch.device("cuda", 0)].any()


def test_a_first_split_k_call_inside_a_capture_says_to_make_an_eager_call_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight, bias = cuda_inputs(1, 1024, 3072, torch.bfloat16, with_bias=False, seed=0)
    gemv(x, weight)  # compiled outside the capture
    monkeypatch.setattr(split_counters, "_counters", {})  # as on a device no split-K call has run on
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="make one eager split gemv call on this device first"):
        with torch.cuda.graph(graph):
            gemv(x, weight)
