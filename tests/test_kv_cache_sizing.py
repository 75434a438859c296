"""How many KV blocks a memory budget becomes (workers/kv_cache.py `num_kv_blocks`): capped where more blocks would
only extend the prefix cache and cost the scheduler its start-up (a 2-layer model on an H200 made 30 million)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.errors import ExplainedError
from workers.kv_cache import MAX_KV_BLOCKS, cap_kv_blocks, num_kv_blocks


def _config(**overrides: object) -> SimpleNamespace:
    fields = dict(kv_cache_memory_gb=1.0, num_kvcache_blocks=None, block_size=16, max_num_seqs=256,
                  max_model_len=1024)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _cpu_blocks(cfg: SimpleNamespace, per_block: int) -> int:
    return num_kv_blocks(cfg, per_block, torch.device("cpu"), 0, lambda: 0)  # type: ignore[arg-type]


def test_a_budget_of_more_blocks_than_the_cap_gets_the_cap() -> None:
    # 1 GiB of 256-byte blocks is 4 million blocks; 256 sequences of 1,024 tokens fill 16,384.
    assert _cpu_blocks(_config(), per_block=256) == MAX_KV_BLOCKS


def test_a_budget_under_the_cap_is_used_whole() -> None:
    assert _cpu_blocks(_config(), per_block=4096) == (1 << 30) // 4096


def test_the_cap_grows_to_what_the_running_sequences_can_fill_at_once() -> None:
    cfg = _config(max_num_seqs=1024, max_model_len=32768)  # 1,024 x 2,048 blocks: twice MAX_KV_BLOCKS
    assert cap_kv_blocks(10 * MAX_KV_BLOCKS, cfg) == 1024 * 2048
    assert cap_kv_blocks(1000, cfg) == 1000


def test_a_forced_block_count_is_never_capped() -> None:
    cfg = _config(num_kvcache_blocks=MAX_KV_BLOCKS + 5)
    assert _cpu_blocks(cfg, per_block=16) == MAX_KV_BLOCKS + 5


def test_a_budget_the_host_cannot_hold_is_still_refused_before_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "host_memory_available", lambda: 1 << 30)
    with pytest.raises(ExplainedError, match="does not fit in this host's available memory"):
        _cpu_blocks(_config(kv_cache_memory_gb=4.0), per_block=256)
