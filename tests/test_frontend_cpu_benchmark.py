"""benchmarks/frontend_cpu.py drives the real frontend's step handler: every kind of request it times is
registered, gets its tokens in every step, and ends in the last one (`measure` checks both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.frontend_cpu import KINDS, measure


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_is_timed_over_every_step(tiny_qwen3: Path, kind: str) -> None:
    times = measure(str(tiny_qwen3), kind, rows=8, steps=12)
    assert len(times) == 12 and all(t >= 0 for t in times) and sum(times) > 0
