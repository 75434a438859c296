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


@pytest.mark.parametrize("prompts", [None, 5, 2.5, {"role": "user", "content": "hi"}, {"a", "b"}])
def test_prompts_that_are_not_a_prompt_or_a_list_are_named(llm: LLM, prompts: object) -> None:  # noqa: F811
    with pytest.raises(TypeError, match=f"^prompts must be a text, token ids, or a list of them, got "
                                        f"{type(prompts).__name__}$"):
        llm.generate(prompts, GREEDY4, use_tqdm=False)


def test_a_client_in_use_by_one_thread_refuses_another_at_once_and_serves_the_first(llm: LLM) -> None:  # noqa: F811
    """ZeroMQ sockets are not thread-safe: a second thread calling a client while another thread's
    generate() runs gets a clear error (it used to hang forever, its outputs taken by the other thread);
    the first thread's request finishes, and taking turns across threads works."""
    import threading

    from frontend.client import EngineClient

    client = EngineClient(llm.engine.endpoints.client)
    try:
        long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        first = client.generate("Tell me a story", long, stream=True)
        outputs = [next(first)]  # under way in this thread
        errors: list[BaseException] = []

        def other() -> None:
            try:
                list(client.generate("hi", GREEDY4))
            except RuntimeError as exc:
                errors.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive()
        assert len(errors) == 1 and "in use by another thread" in str(errors[0])
        outputs += list(first)
        assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) == 64

        turn: list[list] = []
        t = threading.Thread(target=lambda: turn.append(list(client.generate("hi", GREEDY4, stream=False))))
        t.start()
        t.join(timeout=60)
        assert turn and turn[0][-1].finished and len(turn[0][-1].token_ids) == 4
    finally:
        client.close()
