"""Tensor parallelism on two or more GPUs: every all-reduce path (NCCL, PyTorch's one-shot, ours)
gives the float64 sum within bf16 rounding, eagerly and replayed from CUDA graphs, and ours stays
right over a stress sequence of random sizes mixing eager calls and graph replays. Skipped without
two GPUs; run on the device by `bash scripts/gpu_tests.sh` on a machine with two GPUs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)


def test_nccl_and_peer_memory_all_reduce_give_the_sum_in_and_out_of_cuda_graphs() -> None:
    from benchmarks.allreduce import run

    # 1..1024 rows take the peer path; 2048 and 8192 rows (16, 64 MiB) exceed its buffer: NCCL only.
    results = run(2, (1, 3, 64, 512, 1024, 2048, 8192), 4096, calls=4, replays=2)
    assert sorted(results) == [1, 3, 64, 512, 1024, 2048, 8192]
    assert all(results[r]["ours"] is not None for r in (1, 3, 64, 512, 1024))
    assert results[8192]["ours"] is None and results[8192]["nccl"] is not None
