"""Structured outputs on the built-in demo model (SmolLM2-135M-Instruct, real weights): the 20 JSON schemas
of tests/structured_schemas.py, greedy and at temperature 1, each output that ends with `stop` valid against
its schema; and a chat reply constrained to a choice."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deltaserve import LLM, SamplingParams
from frontend.default_model import ensure_default_model
from tests.structured_schemas import SCHEMAS


@pytest.fixture(scope="module")
def demo() -> LLM:
    engine = LLM(ensure_default_model(verbose=False), device="cpu", max_model_len=1024)
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_twenty_schemas_give_valid_json_on_the_demo_model_greedy_and_at_temperature_1(demo: LLM) -> None:
    conversations = [[{"role": "user", "content": "Reply with one JSON value."}]] * (2 * len(SCHEMAS))
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=80, structured_outputs={"json": s})
              for temperature in (0.0, 1.0) for i, s in enumerate(SCHEMAS)]  # one batch: 40 rows
    outs = demo.chat(conversations, params, use_tqdm=False)
    stopped = 0
    for out, schema in zip(outs, SCHEMAS + SCHEMAS):
        assert out["finish_reason"] in ("stop", "length"), out
        if out["finish_reason"] == "stop":
            stopped += 1
            jsonschema.validate(json.loads(out["text"]), schema, format_checker=jsonschema.FormatChecker())
    assert stopped >= 32, [o["text"] for o in outs]


def test_a_chat_reply_constrained_to_a_choice_is_one_of_them(demo: LLM) -> None:
    out = demo.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"choice": ["Paris", "Lyon"]}),
                    use_tqdm=False)[0]
    assert out["text"] in ("Paris", "Lyon") and out["finish_reason"] == "stop"


def test_tools_are_refused_by_name_since_the_demo_models_template_renders_none(demo: LLM) -> None:
    """SmolLM2's chat template never names `tools`: the model could not see them, so a forced call would be
    blind; the request fails alone, naming tools."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    (out,) = demo.chat([{"role": "user", "content": "Weather in Paris?"}], SamplingParams(max_tokens=8),
                       use_tqdm=False, tools=[tool], tool_choice="required")

    assert out["finish_reason"] == "error" and out["error"].startswith("tools: the chat template of this model does "
                                                                      "not render tools")
