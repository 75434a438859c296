"""gemv compiled for a real GPU, on the linear layers of Qwen3-0.6B and Qwen3-8B at decode batches 1..16.

Each result is the exact product up to float32 summation and one rounding (`assert_rounded_float32_sum`, the
bound of the CPU tests), the same bits on a second call and inside a CUDA graph, with no host synchronisation.
Run with `pytest -m gpu tests/kernels/test_gemv_gpu.py` on a CUDA machine (scripts/gpu_tests.sh runs it).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.gemv import choose_gemv_config, gemv  # noqa: E402

from .test_gemv import assert_rounded_float32_sum  # noqa: E402

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
