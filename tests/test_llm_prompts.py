"""What `LLM.generate` takes as its prompts: any iterable of prompts, and a clear error naming the
prompt of the wrong type."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from tests.test_engine_e2e import llm  # noqa: F401  (the engine fixture, started once for this module)

GREEDY4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_a_generator_of_prompts_is_taken_like_a_list(llm: LLM) -> None:  # noqa: F811
    prompts = ["hello", [5, 6, 7]]
    expected = [o["token_ids"] for o in llm.generate(prompts, GREEDY4, use_tqdm=False)]
    got = [o["token_ids"] for o in llm.generate((p for p in prompts), GREEDY4, use_tqdm=False)]
    assert got == expected and all(len(t) == 4 for t in got)


@pytest.mark.parametrize("prompts", [[[1.0, 2.0], "Hello"], ["Hello", None]])
def test_a_prompt_of_the_wrong_type_is_named_by_its_index(llm: LLM, prompts: list) -> None:  # noqa: F811
    bad = next(i for i, p in enumerate(prompts) if p != "Hello")
    with pytest.raises(TypeError, match=f"^prompt {bad}: "):
        llm.generate(prompts, GREEDY4, use_tqdm=False)


def test_the_zmq_client_names_wrong_sampling_params_and_its_own_closing(llm: LLM) -> None:  # noqa: F811
    from frontend.client import EngineClient, EngineConnectionError

    client = EngineClient(llm.engine.endpoints.client)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got dict"):
        next(client.generate("hi", {"temperature": 0}))
    assert [o.finished for o in client.generate("hi", GREEDY4, stream=False)] == [True]
    client.close()
    with pytest.raises(EngineConnectionError, match="has been closed"):
        next(client.generate("hi", GREEDY4))
