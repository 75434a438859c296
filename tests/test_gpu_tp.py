"""Tensor parallelism on two or more GPUs: the all-reduce paths give the float64 sum within bf16
rounding, eagerly and replayed from CUDA graphs. Skipped without 2 GPUs; run on the device by
`bash scripts/gpu_tests.sh` on a machine with two GPUs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)


def test_nccl_and_peer_memory_all_reduce_give_the_sum_in_and_out_of_cuda_graphs() -> None:
    from benchmarks.allreduce import run

    # 1..512 rows take the peer path; 2048 and 8192 rows (16, 64 MiB) exceed its buffer and go to NCCL.
    results = run(2, (1, 3, 64, 512, 2048, 8192), 4096, calls=4, replays=2)
    assert sorted(results) == [1, 3, 64, 512, 2048, 8192]
    assert all(results[r]["peer one-shot"] is not None for r in (1, 3, 64, 512))
    assert results[8192]["peer one-shot"] is None
