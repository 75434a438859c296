"""Messages a user reads: counts in the singular when there is one, sizes in a unit that shows them, the real
limit of a token id, and a refused duplicate request id a raw client can tell from its live request."""

from __future__ import annotations

import numpy as np
import pytest

from common import ipc
from common.limits import prompt_limit_error
from common.protocol import ErrorReply, GenerateRequest, RequestOutputs, Submit, decode
from common.units import count, format_bytes
from deltaserve import LLM, EngineClient, SamplingParams
from tests.test_engine_e2e import llm  # noqa: F401  (the engine fixture, started once for this module)


def test_a_count_of_one_is_in_the_singular() -> None:
    assert [count(n, "block") for n in (0, 1, 2)] == ["0 blocks", "1 block", "2 blocks"]
    assert count(1, "KV-cache block") == "1 KV-cache block" and count(3, "entry", "entries") == "3 entries"


def test_a_size_is_written_in_the_largest_unit_that_keeps_it_at_least_one() -> None:
    assert [format_bytes(n) for n in (0, 512, 8192, 1100, 294_912, 1.5 * 2**30, 100_000 * 2**30)] == [
        "0 B", "512 B", "8 KiB", "1.07 KiB", "288 KiB", "1.5 GiB", "97.7 TiB"]


def test_prompt_limits_count_tokens_and_blocks_in_the_singular_when_there_is_one() -> None:
    assert prompt_limit_error(np.array([5]), max_model_len=1, block_size=16, num_kv_blocks=8, vocab_size=100) == (
        "the prompt has 1 token but max_model_len is 1: a prompt must be shorter than max_model_len to leave room "
        "for output")
    assert prompt_limit_error(np.arange(17), max_model_len=64, block_size=16, num_kv_blocks=1, vocab_size=100) == (
        "the prompt has 17 tokens and needs 2 KV-cache blocks of 16 tokens, but the whole cache has only 1 block")


@pytest.mark.parametrize("ids", [np.array([5, 2**63 + 5], dtype=np.uint64), [5, 2**64 - 1]])
def test_a_token_id_past_2_63_is_refused_naming_the_vocabulary_not_64_bits(llm: LLM, ids: object) -> None:  # noqa: F811
    out = llm.generate([ids, "fine"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    top = max(int(i) for i in ids)
    assert out[0]["error"] == f"prompt token ids must be in [0, 151669); got min 5, max {top}"
    assert out[0]["num_prompt_tokens"] == 2
    assert out[1]["error"] is None and len(out[1]["token_ids"]) >= 1


def test_a_duplicate_live_request_id_is_refused_apart_and_the_live_request_runs_on(llm: LLM) -> None:  # noqa: F811
    client = EngineClient(llm.engine.endpoints.client)
    long = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    try:
        ipc.send(client.sock, Submit([GenerateRequest("x", prompt="Tell me a story", sampling=long)]))
        ipc.send(client.sock, Submit([GenerateRequest("x", prompt="hi"),
                                      GenerateRequest("y", prompt="hi", sampling={"max_tokens": 2})]))
        finished, refusals = {}, []
        while len(finished) < 2:
            assert client.sock.poll(60_000), "the engine stopped answering"
            msg = decode(client.sock.recv())
            if isinstance(msg, ErrorReply):
                refusals.append(msg)
            elif isinstance(msg, RequestOutputs):
                finished.update({o.request_id: o for o in msg.outputs if o.finished})
    finally:
        client.close()
    (refusal,) = refusals
    assert refusal.refused_request_ids == ["x"] and "a live request of this client" in refusal.error
    assert finished["x"].error is None and len(finished["x"].token_ids) == 40  # the live one, untouched
    assert finished["y"].error is None and len(finished["y"].token_ids) == 2
