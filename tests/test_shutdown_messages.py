"""What a client and the user are told when the engine goes down: the process that ended it, and how,
in one clear line (a traceback only for an error nobody anticipated)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from deltaserve import SamplingParams
from frontend.launcher import EngineDeadError

GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_a_firing_step_watchdog_is_logged_as_its_message_without_a_traceback(
        tiny_qwen3: Path, engine_factory, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_S", "2")
    llm = engine_factory(tiny_qwen3, block_size=16, max_model_len=256)
    assert llm.generate(["warm"], GREEDY8, use_tqdm=False)[0]["token_ids"]
    os.kill(llm.engine.procs["worker-tp0"].pid, signal.SIGSTOP)
    with pytest.raises(EngineDeadError, match="has not finished after"):
        llm.generate(["still there?"], GREEDY8, use_tqdm=False)
    err = capfd.readouterr().err
    assert "[scheduler] fatal error: step " in err and "DELTASERVE_STEP_TIMEOUT_S=2" in err, err
    assert "Traceback" not in err, err
