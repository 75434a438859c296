"""Structured outputs through the whole engine on a tiny random-weight model (random logits are the hardest
case for a mask: the model never wants what the grammar allows): JSON schemas, regex, choice and EBNF
constraints, greedy and at temperature 1; unconstrained neighbours unaffected; chunked prefill, preemption
and n > 1; and every way a constraint can be bad, refused by name for that request alone."""

from __future__ import annotations

import itertools
import json
import queue
import re
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from common.protocol import CompileGrammars, GrammarSpec, GrammarToCompile
from deltaserve import LLM, SamplingParams
from tests.conftest import synthetic_prompt
from tests.structured_schemas import SCHEMAS

PROMPT = synthetic_prompt(11, seed=7)
FORMATS = jsonschema.FormatChecker()
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num " + " num\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):
    engine = LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=512, num_kvcache_blocks=400)
    yield engine
    engine.shutdown()


def assert_valid_json(out: dict, schema: dict) -> None:
    """A finished output parses and validates; one cut by max_tokens (`length`) is a prefix the grammar allows."""
    for sample in out["outputs"]:
        assert sample["finish_reason"] in ("stop", "length"), sample
        if sample["finish_reason"] == "stop":
            jsonschema.validate(json.loads(sample["text"]), schema, format_checker=FORMATS)


def json_params(schema: dict, **kwargs: object) -> SamplingParams:
    return SamplingParams(structured_outputs={"json": schema}, **{"max_tokens": 120, **kwargs})


# ============================================================================ JSON schemas
@pytest.mark.parametrize(("temperature", "any_whitespace"), [(0.0, True), (1.0, False)])
def test_twenty_schemas_give_valid_json_on_a_random_model(llm: LLM, temperature: float, any_whitespace: bool) -> None:
    """(A random model spends most of its tokens on the whitespace it may put between elements: at temperature 1
    it may put none, which keeps the test short.)"""
    so = [{"json": s, "disable_any_whitespace": not any_whitespace} for s in SCHEMAS]
    params = [SamplingParams(structured_outputs=so[i], temperature=temperature, seed=i, max_tokens=120)
              for i in range(len(SCHEMAS))]
    outs = llm.generate([PROMPT] * len(SCHEMAS), params, use_tqdm=False)
    for out, schema in zip(outs, SCHEMAS):
        assert_valid_json(out, schema)
    stopped = sum(o["finish_reason"] == "stop" for o in outs)
    assert stopped >= 15, [o["text"] for o in outs]  # bounded schemas: most end within 120 tokens


def test_json_object_gives_a_json_object_and_a_schema_given_as_text_counts_as_the_schema(llm: LLM) -> None:
    outs = llm.generate([PROMPT] * 2, [
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs={"json_object": True}),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": json.dumps(SCHEMAS[1])})],
        use_tqdm=False)
    if outs[0]["finish_reason"] == "stop":
        assert isinstance(json.loads(outs[0]["text"]), dict)
    assert outs[0]["text"].startswith("{")
    assert outs[1]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(outs[1]["text"]), SCHEMAS[1])


def test_no_whitespace_when_any_whitespace_is_disabled(llm: LLM) -> None:
    so = {"json": SCHEMAS[4], "disable_any_whitespace": True}
    outs = llm.generate([PROMPT] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=so)
                                       for s in range(4)], use_tqdm=False)
    for out in outs:
        assert_valid_json(out, SCHEMAS[4])
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"?', '""', out["text"])  # a cut output may end in a string
        assert not re.search(r"\s", outside_strings), out["text"]  # not even xgrammar's ", " and ": "


# ============================================================================ regex, choice, EBNF
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_ebnf_outputs_are_in_their_language(llm: LLM, temperature: float) -> None:
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    choices = ["yes", "no", "maybe later"]
    params = []
    for seed in range(4):
        kw = {"temperature": temperature, "seed": seed, "max_tokens": 30}
        params += [SamplingParams(structured_outputs={"regex": regex}, **kw),
                   SamplingParams(structured_outputs={"choice": choices}, **kw),
                   SamplingParams(structured_outputs={"grammar": EBNF}, **kw)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out["finish_reason"] == "stop", out  # each language is finite and short
        text = out["text"]
        if i % 3 == 0:
            assert re.fullmatch(regex, text), text
        elif i % 3 == 1:
            assert text in choices
        else:
            assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", text), text


def test_a_constrained_request_cut_by_max_tokens_ends_with_length_and_returns_what_it_has(llm: LLM) -> None:
    out = llm.generate([PROMPT], json_params(SCHEMAS[19], temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5
    assert out["text"].startswith("{")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_token_the_grammar_forces_has_logprob_0_rank_1_and_itself_as_the_only_top_entry(
        llm: LLM, temperature: float) -> None:
    """docs/parameters.md#logprobs: the regex "a" allows one token of the vocabulary first; the masked tokens'
    logprobs are -inf and are not listed, though 5 were asked for."""
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=4, logprobs=5,
                            structured_outputs={"regex": "a"})
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    first = out["outputs"][0]["logprobs"][0]
    assert out["text"] == "a" and out["finish_reason"] == "stop"
    assert (first["logprob"], first["rank"]) == (0.0, 1)
    assert [(t["token_id"], t["logprob"]) for t in first["top"]] == [(first["token_id"], 0.0)]


UNBOUNDED_INTEGER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_an_output_cut_by_max_tokens_before_its_constraint_is_complete_says_so(llm: LLM) -> None:
    """A fresh user's json_schema integer without `maximum` ran to max_tokens ("1111...", finish "length", no valid
    JSON), and nothing said that the constraint had not finished. Here: a choice one token cannot finish, one token
    that does finish its choice (the end token would have come next), JSON cut early (llguidance), and each of two
    samples on its own. (The log line naming the request: tests/test_openai_server.py.)"""
    choice = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs={"choice": ["abcdef ghijkl"]})
    done = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs={"choice": ["a"]})
    two = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=3, structured_outputs={"json": UNBOUNDED_INTEGER})
    outs = llm.generate([PROMPT] * 4, [choice, done, json_params(UNBOUNDED_INTEGER, max_tokens=3), two],
                        use_tqdm=False)
    assert [o["finish_reason"] for o in outs] == ["length"] * 4
    assert [o["structured_output_incomplete"] for o in outs] == [True, False, True, True]
    assert outs[1]["text"] == "a"
    assert [s["structured_output_incomplete"] for s in outs[3]["outputs"]] == [True, True]


def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(llm: LLM) -> None:
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=12, top_k=50, max_tokens=12, ignore_eos=True)]
    prompts = [synthetic_prompt(9 + i, seed=40 + i) for i in range(3)]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = [json_params(s, temperature=1.0, seed=i) for i, s in enumerate(SCHEMAS[:6])]
    mixed = llm.generate(prompts + [PROMPT] * 6, plain + constrained, use_tqdm=False)
    assert [o["token_ids"] for o in mixed[:3]] == [o["token_ids"] for o in alone]
    for out, schema in zip(mixed[3:], SCHEMAS[:6]):
        assert_valid_json(out, schema)


def test_seeded_constrained_requests_give_the_same_tokens_alone_batched(llm: LLM) -> None:
    """The matcher of each row stands at its own tokens (pipelined steps: the token of step N reaches it before
    step N+1's mask), whatever else runs in the batch."""
    params = [json_params(SCHEMAS[i], temperature=1.0, seed=100 + i) for i in (0, 3, 10, 19)]
    alone = [llm.generate([PROMPT], p, use_tqdm=False)[0]["token_ids"] for p in params]
    batched = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    assert [o["token_ids"] for o in batched] == alone


# ============================================================================ chunked prefill, preemption, n > 1
def test_constrained_outputs_stay_the_same_chunked_and_preempted(llm: LLM, tiny_qwen3: Path, engine_factory) -> None:
    prompts = [synthetic_prompt(40 + 3 * i, seed=60 + i) for i in range(8)]
    params = [json_params(SCHEMAS[(5 * i) % 20], temperature=1.0, seed=200 + i, max_tokens=60) for i in range(8)]
    reference = llm.generate(prompts, params, use_tqdm=False)
    small = engine_factory(tiny_qwen3, block_size=8, max_model_len=512, max_num_batched_tokens=16,
                           num_kvcache_blocks=40)
    squeezed = small.generate(prompts, params, use_tqdm=False)
    assert sum(o["metrics"]["num_preemptions"] for o in squeezed) > 0, "the small cache should force preemption"
    assert [o["token_ids"] for o in squeezed] == [o["token_ids"] for o in reference]
    for out, p in zip(squeezed, params):
        assert_valid_json(out, p.structured_outputs.json)


def test_each_of_n_samples_follows_the_schema_with_its_own_matcher(llm: LLM) -> None:
    out = llm.generate([PROMPT], json_params(SCHEMAS[9], temperature=1.0, seed=5, n=4), use_tqdm=False)[0]
    assert len(out["outputs"]) == 4
    assert_valid_json(out, SCHEMAS[9])
    assert len({tuple(s["token_ids"]) for s in out["outputs"]}) > 1  # distinct samples, each valid


# ============================================================================ forced tool calls
CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_valid_on_a_random_model_through_the_offline_api(llm: LLM, tool_choice: object) -> None:
    """LLM.chat(tools=..., tool_choice=...) needs no tool-call parser for a forced call: the grammar writes it."""
    outs = llm.chat([{"role": "user", "content": "Weather in Oslo?"}],
                    SamplingParams(temperature=1.0, seed=3, max_tokens=120, n=2),
                    use_tqdm=False, tools=[CITY_TOOL], tool_choice=tool_choice, parallel_tool_calls=False)

    for sample in outs[0]["outputs"]:
        assert sample["finish_reason"] == "stop", sample["text"]
        (call,) = sample["tool_calls"]
        assert call["function"]["name"] == "get_weather" and sample["content"] is None
        jsonschema.validate(json.loads(call["function"]["arguments"]), CITY_TOOL["function"]["parameters"])
    assert outs[0]["tool_calls"] == outs[0]["outputs"][0]["tool_calls"]


# ============================================================================ the two libraries
def test_the_xgrammar_backend_gives_valid_json_for_the_twenty_schemas(tiny_qwen3: Path, engine_factory) -> None:
    engine = engine_factory(tiny_qwen3, device="cpu", block_size=16, max_model_len=512, num_kvcache_blocks=400,
                            structured_outputs_backend="xgrammar")
    params = [SamplingParams(structured_outputs={"json": s}, temperature=1.0, seed=i, max_tokens=120)
              for i, s in enumerate(SCHEMAS)]
    outs = engine.generate([PROMPT] * len(SCHEMAS), params, use_tqdm=False)
    for out, schema in zip(outs, SCHEMAS):
        assert_valid_json(out, schema)
    assert sum(o["finish_reason"] == "stop" for o in outs) >= 15, [o["text"] for o in outs]


@pytest.fixture(scope="module")
def manager(qwen3_tokenizer_dir: Path):
    """A worker's structured-output manager on the Qwen3 tokenizer (two end tokens), without an engine."""
    from workers.structured_output import StructuredOutputManager

    reports: queue.Queue = queue.Queue()
    m = StructuredOutputManager(str(qwen3_tokenizer_dir), 151936, [151645, 151643], 0, reports.put, threads=2)
    yield m, reports
    m.close()


GRAMMAR_IDS = itertools.count(1)


def compiled(manager, specs: list[GrammarSpec]) -> list:
    """A new matcher of each of `specs`, compiled by `manager` (a (StructuredOutputManager, its reports) pair)."""
    m, reports = manager
    first = next(GRAMMAR_IDS) * 100
    m.compile(CompileGrammars([GrammarToCompile(first + i, s) for i, s in enumerate(specs)]))
    done = sorted((reports.get(timeout=60) for _ in specs), key=lambda r: r.grammar_id)
    assert [r.error for r in done] == [None] * len(specs)
    return [m.new_grammar(first + i) for i in range(len(specs))]


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_json_constraints_get_llguidance_matchers_and_the_others_xgrammar_ones(manager) -> None:
    grammars = compiled(manager, [GrammarSpec("json", '{"type": "integer"}'), GrammarSpec("json_object", ""),
                                  GrammarSpec("regex", "[ab]+"), GrammarSpec("choice", '["x", "y"]'),
                                  GrammarSpec("grammar", 'root ::= "z"')])
    assert [g.guidance for g in grammars] == [True, True, False, False, False]


def test_every_end_token_is_allowed_where_a_json_grammar_may_end_and_only_they_once_it_is_complete(manager) -> None:
    m, _ = manager
    tokenizer = AutoTokenizer.from_pretrained(m.tokenizer_dir)
    number, flag = compiled(manager, [GrammarSpec("json", '{"type": "integer"}'),
                                      GrammarSpec("json", '{"type": "boolean"}')])
    one, true = tokenizer.encode("1", add_special_tokens=False), tokenizer.encode("true", add_special_tokens=False)
    assert len(one) == len(true) == 1
    assert m.accept([number, flag], [one[0], true[0]]) == {}
    mask = m.fill_bitmask([number, flag])
    assert {151645, 151643} <= allowed(mask, 0) and one[0] in allowed(mask, 0)  # "12" or the end
    assert flag.complete() and allowed(mask, 1) == {151643, 151645}
    assert m.accept([flag], [151645]) == {} and allowed(m.fill_bitmask([flag]), 0) == {151643, 151645}


THINK_START, THINK_END = 151667, 151668  # Qwen3's <think> and </think>


@pytest.mark.parametrize("kind", ["json", "regex"])  # an llguidance matcher and an xgrammar one
def test_a_grammar_waits_for_the_end_of_the_reasoning_then_constrains_the_answer(manager, kind: str) -> None:
    m, _ = manager
    tokenizer = AutoTokenizer.from_pretrained(m.tokenizer_dir)
    spec = GrammarSpec("json", '{"type": "integer"}') if kind == "json" else GrammarSpec("regex", "[0-9]+")
    (plain,) = compiled(manager, [spec])
    gid = plain.grammar_id
    words = tokenizer.encode("Let me think: letters.", add_special_tokens=False)
    one = tokenizer.encode("1", add_special_tokens=False)[0]
    inside = m.new_grammar(gid, reasoning_end=THINK_END)  # the prompt opened the reasoning (or deepseek_r1)

    assert len(allowed(m.fill_bitmask([inside]), 0)) >= 151643  # every token while it thinks
    assert all(m.accept([inside], [t]) == {} for t in words)  # letters: outside the grammar, yet not refused
    assert m.accept([inside], [THINK_END]) == {} and not inside.thinking
    answer = allowed(m.fill_bitmask([inside]), 0)
    assert one in answer and words[0] not in answer and THINK_START not in answer
    assert m.accept([inside], [one]) == {}


def test_a_qwen3_output_may_open_its_reasoning_with_the_first_token_only(manager) -> None:
    m, _ = manager
    tokenizer = AutoTokenizer.from_pretrained(m.tokenizer_dir)
    (plain,) = compiled(manager, [GrammarSpec("json", '{"type": "integer"}')])
    one = tokenizer.encode("1", add_special_tokens=False)[0]
    thinks = m.new_grammar(plain.grammar_id, reasoning_end=THINK_END, reasoning_start=THINK_START)
    answers = m.new_grammar(plain.grammar_id, reasoning_end=THINK_END, reasoning_start=THINK_START)

    first = m.fill_bitmask([thinks, answers])
    assert allowed(first, 0) == allowed(first, 1) == allowed(m.fill_bitmask([plain]), 0) | {THINK_START}
    assert m.accept([thinks, answers], [THINK_START, one]) == {}
    assert thinks.thinking and not answers.thinking and not answers.may_open
    second = m.fill_bitmask([thinks, answers])
    assert len(allowed(second, 0)) >= 151643 and THINK_START not in allowed(second, 1)
    assert m.accept([answers], [THINK_START]) != {}  # once the answer began, the tag is outside the grammar


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_properties_beyond_those_a_schema_lists_are_refused_by_either_library(qwen3_tokenizer_dir: Path,
                                                                              backend: str) -> None:
    """xgrammar's strict mode, which llguidance gets as additionalProperties false (`strict_schema`)."""
    from workers.structured_output import StructuredOutputManager

    reports: queue.Queue = queue.Queue()
    m = StructuredOutputManager(str(qwen3_tokenizer_dir), 151936, [151645], 0, reports.put, threads=1,
                                backend=backend)
    inner = {"type": "object", "properties": {"b": {"type": "integer"}, "d": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": inner}}
    (g,) = compiled((m, reports), [GrammarSpec("json", json.dumps(schema), any_whitespace=False)])
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    ids = tokenizer.encode('{"a":{"b":1,"c', add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert pieces[-1] == "c", pieces  # '"d' may follow '"b":1,', 'c' may not
    refused = [bool(m.accept([g], [t])) for t in ids]
    m.close()
    assert refused == [False] * (len(pieces) - 1) + [True], pieces


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_a_preload_builds_the_backends_tokenizer_views_that_the_first_grammar_then_uses(qwen3_tokenizer_dir: Path,
                                                                                        backend: str) -> None:
    """Built on the first constrained request, the views held the GIL and stopped every other request's step for
    up to 2 s (`StructuredOutputManager.preload`): preloaded, the first grammar compiles with them as they are."""
    from workers.structured_output import StructuredOutputManager

    reports: queue.Queue = queue.Queue()
    m = StructuredOutputManager(str(qwen3_tokenizer_dir), 151936, [151645], 0, reports.put, threads=1,
                                backend=backend)
    m.preload()
    deadline = time.monotonic() + 60
    while m._compiler is None or (backend == "auto" and m._lltokenizer is None):
        assert time.monotonic() < deadline, "the preload did not build the views within 60 s"
        time.sleep(0.05)
    views = (m._tokenizer, m._compiler, m._lltokenizer)
    assert (m._lltokenizer is None) == (backend == "xgrammar")  # JSON goes to xgrammar there: no llguidance view
    specs = [GrammarSpec("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
             GrammarSpec("regex", "[0-9]+")]
    assert len(compiled((m, reports), specs)) == 2
    assert (m._tokenizer, m._compiler, m._lltokenizer) == views
    assert reports.empty()  # the preload reports nothing: no grammar of the scheduler's was compiled
    m.close()


def test_a_preload_that_cannot_read_the_tokenizer_leaves_the_error_to_the_first_grammar(tmp_path: Path) -> None:
    from workers.structured_output import StructuredOutputManager

    reports: queue.Queue = queue.Queue()
    m = StructuredOutputManager(str(tmp_path), 151936, [151645], 0, reports.put, threads=1)
    m.preload()
    m.compile(CompileGrammars([GrammarToCompile(1, GrammarSpec("regex", "[0-9]+"))]))
    report = reports.get(timeout=60)
    m.close()
    assert report.grammar_id == 1 and "cannot be used for structured outputs" in report.error, report


def test_strict_schema_closes_every_object_schema_but_leaves_values_and_set_choices_alone() -> None:
    from workers.structured_output import strict_schema

    obj = {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"properties": {"b": {"enum": [obj], "default": obj}}},
                                               "c": {"type": "array", "items": obj},
                                               "d": {"anyOf": [obj, {"type": "null"}]},
                                               "e": {"type": "object", "additionalProperties": True},
                                               "f": {"$ref": "#/$defs/g"}},
              "$defs": {"g": {"type": ["object", "null"]}}}
    closed = strict_schema(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["a"]["properties"]["b"] == {"enum": [obj], "default": obj}  # values, not schemas
    assert props["c"]["items"] == {"type": "object", "additionalProperties": False}
    assert props["d"]["anyOf"] == [{"type": "object", "additionalProperties": False}, {"type": "null"}]
    assert props["e"]["additionalProperties"] is True and props["f"] == {"$ref": "#/$defs/g"}
    assert closed["$defs"]["g"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and obj == {"type": "object"}  # the input is left as it was


# ============================================================================ bad constraints
@pytest.mark.parametrize(("so", "message"), [
    ({"regex": "(abc"}, "structured_outputs.regex: the regex cannot be compiled"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar: the EBNF grammar cannot be compiled"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
     "structured_outputs.json: the JSON schema cannot be compiled"),
])
def test_a_constraint_the_library_cannot_compile_fails_that_request_alone(llm: LLM, so: dict, message: str) -> None:
    good = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs={"choice": ["ok", "fine"]})
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([PROMPT] * 3, [SamplingParams(max_tokens=8, structured_outputs=so), good, plain],
                        use_tqdm=False)
    assert outs[0]["finish_reason"] == "error" and outs[0]["error"].startswith(message), outs[0]["error"]
    assert outs[1]["text"] in ("ok", "fine") and len(outs[2]["token_ids"]) == 4
    again = llm.generate([PROMPT], SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False)[0]
    assert again["error"] == outs[0]["error"]  # remembered: the same bad constraint fails at once, the same way


def test_a_step_of_prefill_chunks_that_sample_nothing_has_no_logits_processing() -> None:
    from workers.logits_processing import build_processing

    assert build_processing([], np.zeros(0, np.float32), 1000) is None


def test_the_schema_true_is_the_empty_schema_and_the_params_class_is_importable_from_deltaserve() -> None:
    from deltaserve import StructuredOutputsParams

    assert StructuredOutputsParams(json=True).json == {}
    assert StructuredOutputsParams(json="true").json == {}


def test_a_library_error_keeps_every_line_of_its_reason() -> None:
    from workers.structured_output import library_error

    llguidance_like = ValueError("regex parse error:\n    (a\n    ^\nerror: unclosed group")
    assert library_error(llguidance_like) == "regex parse error: (a ^ error: unclosed group"
    xgrammar_like = RuntimeError("[22:56:34] /project/cpp/regex_converter.cc:94: Regex parsing error at position 3: "
                                 "Lookahead is not supported yet.\n")
    assert library_error(xgrammar_like) == "Regex parsing error at position 3: Lookahead is not supported yet."
    assert len(library_error(ValueError("x" * 5000))) == 600


@pytest.mark.parametrize(("so", "message"), [
    ({}, "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex and choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON text"),
    ({"json": 5}, "structured_outputs.json must be a JSON schema"),
    ({"json": False}, "structured_outputs.json: the schema false accepts no document at all"),
    ({"json": "false"}, "structured_outputs.json: the schema false accepts no document at all"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of non-empty strings"),
    ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": 7}, "structured_outputs.grammar must be a non-empty string"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true or false"),
    ({"json": {}, "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace must be true or false"),
    ({"jsonschema": {}}, "unknown structured_outputs fields ['jsonschema']"),
    ("json", "structured_outputs must be a map"),
])
def test_a_malformed_constraint_is_refused_naming_the_field(so: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=so)


# ============================================================================ command-line flags
def test_the_client_cli_constrains_by_choice_and_by_a_schema_file(llm: LLM, tmp_path: Path, capsys) -> None:
    from frontend.client_cli import main

    code = main(["--address", llm.engine.endpoints.client, "--json", "--max-tokens", "8", "--choice", "yes",
                 "--choice", "no", "Answer:"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["text"] in ("yes", "no") and row["finish_reason"] == "stop", row
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[1]))
    code = main(["--address", llm.engine.endpoints.client, "--json", "--max-tokens", "60", "--temperature", "0",
                 "--json-schema", f"@{schema_file}", "Answer:"])
    row = json.loads(capsys.readouterr().out)
    direct = llm.generate(["Answer:"], json_params(SCHEMAS[1], max_tokens=60, temperature=0.0), use_tqdm=False)[0]
    assert code == 0 and row["token_ids"] == direct["token_ids"]
    assert_valid_json(row, SCHEMAS[1])


@pytest.mark.parametrize(("argv", "message"), [
    (["--regex", "a+", "--choice", "x"], "--choice: only one structured-output flag may be set, got --regex and "
                                         "--choice"),
    (["--json-schema", "{"], "--json-schema: structured_outputs.json is not valid JSON text"),
    (["--json-schema", "[1]"], "--json-schema: structured_outputs.json must be a JSON schema"),
    (["--json-schema", "@/nonexistent/schema.json"], "--json-schema: cannot read '/nonexistent/schema.json'"),
    (["--regex", ""], "--regex: structured_outputs.regex must be a non-empty string"),
    (["--choice", ""], "--choice: structured_outputs.choice must be a non-empty list of non-empty strings"),
])
def test_the_client_cli_refuses_a_bad_structured_output_flag_by_name(argv: list[str], message: str, capsys) -> None:
    from frontend.client_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "hi"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err


def test_launch_refuses_a_bad_structured_output_flag_before_starting_an_engine(tiny_qwen3: Path) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--prompt", "hi", "--device",
                             "cpu", "--json-schema", "{"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--json-schema: structured_outputs.json is not valid JSON text" in result.stderr
