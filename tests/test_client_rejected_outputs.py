"""What a client is told about a request the engine rejects after tokenizing it."""

from __future__ import annotations

from pathlib import Path

from deltaserve import SamplingParams
from tests.conftest import synthetic_prompt


def test_a_prompt_too_long_for_the_whole_cache_reports_its_real_length(tiny_qwen3: Path, engine_factory) -> None:
    small = engine_factory(tiny_qwen3, block_size=16, max_model_len=1024, num_kvcache_blocks=4)

    outs = small.generate([synthetic_prompt(94, 2), synthetic_prompt(6, 1)],
                          SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)

    assert outs[0]["finish_reason"] == "error" and "only 4 blocks" in outs[0]["error"]
    assert outs[0]["num_prompt_tokens"] == 94
    assert outs[1]["error"] is None and outs[1]["num_prompt_tokens"] == 6
