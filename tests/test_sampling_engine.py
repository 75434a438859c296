"""Request parameters through the whole engine (LLM.generate, the ZMQ client, the CLIs) on a tiny random
checkpoint: logprobs and prompt logprobs against transformers, seeded reproducibility of every
parameter combination under batching, chunking and preemption, n > 1, stop strings and stop tokens,
the end-token union, and bad values for every field refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from common import ipc
from common.protocol import GenerateRequest, Submit
from deltaserve import LLM, EngineClient, SamplingParams
from tests.conftest import REPO, make_tiny_checkpoint, synthetic_prompt
from tests.test_engine_vs_hf import _hf_model, hf_greedy

PROMPT = synthetic_prompt(23, seed=31)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):
    engine = LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=512, num_kvcache_blocks=160)
    yield engine
    engine.shutdown()


@cache
def hf_log_softmax(model_dir: str, ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' float32 log_softmax of the next-token logits at every position of `ids`: `[len, vocab]`."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


# ============================================================================ logprobs
def test_logprobs_of_a_greedy_request_are_transformers_log_softmax(llm: LLM, tiny_qwen3: Path) -> None:
    """Greedy: no parameter changes the distribution (temperature 1), so the logprobs are the model's."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5),
                       use_tqdm=False)[0]
    tokens = out["token_ids"]
    assert tokens == hf_greedy(str(tiny_qwen3), tuple(PROMPT))[:6]
    lsm = hf_log_softmax(str(tiny_qwen3), tuple(PROMPT + tokens))
    sample = out["outputs"][0]
    assert len(sample["logprobs"]) == 6
    cumulative = 0.0
    for i, (token, entry) in enumerate(zip(tokens, sample["logprobs"])):
        ref = lsm[len(PROMPT) - 1 + i]
        assert entry["token_id"] == token and entry["rank"] == 1
        assert entry["logprob"] == pytest.approx(ref[token].item(), abs=1e-4)
        top = ref.topk(5)
        assert [t["token_id"] for t in entry["top"]] == top.indices.tolist()
        np.testing.assert_allclose([t["logprob"] for t in entry["top"]], top.values.numpy(), atol=1e-4)
        assert entry["decoded_token"] == llm.tokenizer.decode([token])
        cumulative += entry["logprob"]
    assert sample["cumulative_logprob"] == pytest.approx(cumulative, abs=1e-6)


def test_logprobs_come_from_the_tempered_and_filtered_distribution(llm: LLM, tiny_qwen3: Path) -> None:
    params = SamplingParams(temperature=0.7, top_k=8, max_tokens=5, seed=5, ignore_eos=True, logprobs=20)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    lsm = hf_log_softmax(str(tiny_qwen3), tuple(PROMPT + out["token_ids"]))
    for i, (token, entry) in enumerate(zip(out["token_ids"], out["outputs"][0]["logprobs"])):
        logits = lsm[len(PROMPT) - 1 + i] / 0.7  # log_softmax differs from the logits by a constant
        kept = logits.topk(8)
        ref = torch.log_softmax(kept.values, dim=-1)
        assert token in kept.indices.tolist()
        assert entry["logprob"] == pytest.approx(ref[kept.indices.tolist().index(token)].item(), abs=1e-4)
        assert [t["token_id"] for t in entry["top"]] == kept.indices.tolist()  # 8 kept: only 8 of the 20 asked
        np.testing.assert_allclose([t["logprob"] for t in entry["top"]], ref.numpy(), atol=1e-4)


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_are_transformers_log_softmax_for_every_prompt_token_but_the_first(
        tiny_qwen3: Path, llm: LLM, engine_factory, chunked: bool) -> None:
    """Also when the prompt is prefilled in chunks of 8 and preempted: every position is reported once."""
    engine = engine_factory(tiny_qwen3, block_size=8, max_model_len=512, max_num_batched_tokens=8,
                            num_kvcache_blocks=12) if chunked else llm
    prompt = synthetic_prompt(40, seed=32)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    others = [synthetic_prompt(30, seed=s) for s in (1, 2)]  # compete for the small cache
    outs = engine.generate([prompt, *others, prompt], [params, SamplingParams(max_tokens=40, ignore_eos=True)
                                                       , SamplingParams(max_tokens=40, ignore_eos=True), params],
                           use_tqdm=False)
    lsm = hf_log_softmax(str(tiny_qwen3), tuple(prompt))
    for out in (outs[0], outs[3]):  # the second identical prompt skipped the prefix cache: all reported again
        entries = out["prompt_logprobs"]
        assert len(entries) == len(prompt) and entries[0] is None
        for position in range(1, len(prompt)):
            entry, ref = entries[position], lsm[position - 1]
            assert entry["token_id"] == prompt[position]
            assert entry["logprob"] == pytest.approx(ref[prompt[position]].item(), abs=1e-4)
            # The rank within the same 1e-4: mid-distribution tokens have neighbours closer than that.
            lp = entry["logprob"]
            assert 1 + int((ref > lp + 1e-4).sum()) <= entry["rank"] <= 1 + int((ref > lp - 1e-4).sum())
            assert [t["token_id"] for t in entry["top"]] == ref.topk(3).indices.tolist()
        assert out["num_cached_tokens"] == 0
    if chunked:
        assert sum(o["metrics"]["num_preemptions"] for o in outs) > 0


# ============================================================================ seeded reproducibility
COMBOS = {
    "top-k-p-min-p": dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
    "top-p only": dict(temperature=1.2, top_p=0.7),
    "penalties": dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    "logit-bias": dict(temperature=1.0, logit_bias={100: 5.0, 200: -100.0, 300: 3.0}),
    "bad-words": dict(temperature=1.0, bad_words=["hello", " the world"]),
    "min-tokens": dict(temperature=1.0, min_tokens=6, stop_token_ids=[1000, 2000], logit_bias={1000: 8.0}),
    "n=3": dict(temperature=1.0, n=3, top_k=100),
    "logprobs": dict(temperature=0.6, logprobs=4, top_p=0.95),
    "stop-strings": dict(temperature=1.0, stop=["e", "a"]),
    "temperature only": dict(temperature=0.7),
}


def combo_params(name: str, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=14, ignore_eos=True, seed=seed, **COMBOS[name])


def samples_of(out: dict) -> list[list[int]]:
    return [s["token_ids"] for s in out["outputs"]]


def test_seeded_requests_give_the_same_tokens_alone_batched_chunked_and_preempted(llm: LLM, tiny_qwen3: Path,
                                                                                  engine_factory) -> None:
    names = list(COMBOS)
    prompts = [synthetic_prompt(20 + 3 * i, seed=40 + i) for i in range(len(names))]
    params = [combo_params(name, seed=100 + i) for i, name in enumerate(names)]
    alone = [samples_of(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    fillers = [synthetic_prompt(35, seed=s) for s in range(4)]
    filler_params = [SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True)] * 4
    batched = llm.generate(fillers[:2] + prompts + fillers[2:], filler_params[:2] + params + filler_params[2:],
                           use_tqdm=False)[2:-2]
    small = engine_factory(tiny_qwen3, block_size=8, max_model_len=512, max_num_batched_tokens=16,
                           num_kvcache_blocks=40)
    squeezed = small.generate(fillers + prompts, filler_params + params, use_tqdm=False)
    assert sum(o["metrics"]["num_preemptions"] for o in squeezed) > 0, "the small cache should force preemption"
    for name, a, b, c in zip(names, alone, batched, squeezed[4:]):
        assert a == samples_of(b) == samples_of(c), name
    stop = alone[names.index("stop-strings")]
    assert len(stop[0]) < 14  # the stop strings fired
    assert len(set(map(tuple, alone[names.index("n=3")]))) == 3  # the samples of one request differ


def test_every_parameter_changes_what_a_seeded_request_samples(llm: LLM) -> None:
    """The combinations above are not no-ops: each samples differently from temperature alone."""
    outs = llm.generate([PROMPT] * len(COMBOS), [combo_params(name, seed=7) for name in COMBOS], use_tqdm=False)
    base = outs[list(COMBOS).index("temperature only")]["token_ids"]
    for name, out in zip(COMBOS, outs):
        if name not in ("temperature only", "stop-strings", "logprobs"):
            assert out["token_ids"] != base or name == "bad-words", name


# ============================================================================ n > 1
def test_four_greedy_samples_are_identical_and_seeded_ones_differ(llm: LLM, tiny_qwen3: Path) -> None:
    greedy, seeded = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, n=4, max_tokens=8,
                                                                    ignore_eos=True),
                                                     SamplingParams(temperature=1.0, n=4, max_tokens=8, seed=3,
                                                                    ignore_eos=True)], use_tqdm=False)
    expected = hf_greedy(str(tiny_qwen3), tuple(PROMPT))[:8]
    assert [s["index"] for s in greedy["outputs"]] == [0, 1, 2, 3]
    assert all(s["token_ids"] == expected and s["finish_reason"] == "length" for s in greedy["outputs"])
    assert greedy["token_ids"] == expected and greedy["text"] == greedy["outputs"][0]["text"]
    assert len({tuple(s["token_ids"]) for s in seeded["outputs"]}) == 4
    assert all(len(s["token_ids"]) == 8 for s in seeded["outputs"])
    again = llm.generate([PROMPT], SamplingParams(temperature=1.0, n=4, max_tokens=8, seed=3, ignore_eos=True),
                         use_tqdm=False)[0]
    assert samples_of(again) == samples_of(seeded)
    one = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert one["token_ids"] == seeded["outputs"][0]["token_ids"]  # sample 0 is the request's own seed


def test_streamed_samples_add_up_to_each_final_sample(llm: LLM) -> None:
    client = EngineClient(llm.engine.endpoints.client)
    params = SamplingParams(temperature=1.0, n=3, max_tokens=10, seed=9, ignore_eos=True, logprobs=1)
    try:
        deltas = list(client.generate(PROMPT, params, stream=True))
        (whole,) = list(client.generate(PROMPT, params, stream=False))
    finally:
        client.close()
    texts, ids, lps = {}, {}, {}
    for out in deltas:
        for s in out.outputs:
            texts[s.index] = texts.get(s.index, "") + s.text
            ids.setdefault(s.index, []).extend(s.token_ids)
            lps.setdefault(s.index, []).extend(s.logprobs or [])
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for s in whole.outputs:
        assert (texts[s.index], ids[s.index]) == (s.text, s.token_ids)
        assert [e.token_id for e in lps[s.index]] == s.token_ids == [e.token_id for e in s.logprobs]


def test_n_larger_than_max_num_seqs_is_refused_naming_both(tiny_qwen3: Path, engine_factory) -> None:
    small = engine_factory(tiny_qwen3, block_size=16, max_model_len=256, max_num_seqs=4)
    outs = small.generate(["a", "b"], [SamplingParams(n=5, max_tokens=2), SamplingParams(n=4, max_tokens=2)],
                          use_tqdm=False)
    assert "n must be in [1, max_num_seqs=4]" in outs[0]["error"] and "got 5" in outs[0]["error"]
    assert outs[1]["error"] is None and len(outs[1]["outputs"]) == 4


# ============================================================================ stopping
def test_a_stop_string_ends_the_output_across_tokens_and_frees_the_request(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    tok = llm.tokenizer
    ids, text = full["token_ids"], full["text"]
    # A stop string made of the end of token 3's text and the start of token 5's: it spans three tokens.
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    start, end = len(pieces[2]) - 1, len(pieces[4]) + 1
    stop = text[start:end]
    assert stop and text.index(stop) == start, (text, stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "zzzz"]),
                       use_tqdm=False)[0]
    assert out["text"] == text[:start] and out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["token_ids"] == ids[:6]  # through the token that completed it
    client = EngineClient(llm.engine.endpoints.client)
    try:
        deltas = list(client.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                             stop=stop, include_stop_str_in_output=True)))
    finally:
        client.close()
    assert "".join(d.text for d in deltas) == text[:end] and deltas[-1].stop_reason == stop
    in_prompt = llm.generate([tok.decode(PROMPT)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                  stop=[tok.decode(PROMPT[3:6])]), use_tqdm=False)[0]
    assert in_prompt["finish_reason"] == "length"  # a stop string in the prompt does not fire


def test_a_stop_token_stays_in_the_ids_and_its_text_is_left_out(llm: LLM) -> None:
    """Issue 13: the text ended with <|endoftext|> when special tokens were not skipped. Here the end token
    is forced by a logit bias, after min_tokens."""
    eos = llm.tokenizer.eos_token_id
    eos_text = llm.tokenizer.decode([eos])
    base = dict(temperature=0.0, max_tokens=10, min_tokens=2, logit_bias={eos: 100.0}, skip_special_tokens=False)
    out, kept = llm.generate([PROMPT, PROMPT], [SamplingParams(**base),
                                                SamplingParams(**base, include_stop_str_in_output=True)],
                             use_tqdm=False)
    assert len(out["token_ids"]) == 3 and out["token_ids"][-1] == eos  # masked for two tokens, then forced
    assert out["finish_reason"] == "stop" and out["stop_reason"] is None  # vLLM: no stop reason at the EOS token
    assert not out["text"].endswith(eos_text) and out["text"] == llm.tokenizer.decode(out["token_ids"][:2])
    assert kept["text"].endswith(eos_text)
    user = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[500],
                                                 logit_bias={500: 100.0}, ignore_eos=True,
                                                 skip_special_tokens=False), use_tqdm=False)[0]
    assert user["token_ids"] == [500] and user["text"] == "" and user["stop_reason"] == 500


def test_end_tokens_are_the_tokenizer_eos_and_every_generation_config_id(tmp_path: Path, qwen3_tokenizer_dir: Path,
                                                                         engine_factory) -> None:
    model = make_tiny_checkpoint("qwen3", tmp_path / "two-eos", qwen3_tokenizer_dir)
    greedy = hf_greedy(str(model), tuple(PROMPT))
    a, b = greedy[2], greedy[4]
    assert len({a, b} & set(greedy[:4])) == 1, "pick end ids that first appear at steps 3 and 5"
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [a, b]}))
    llm = engine_factory(model, block_size=16, max_model_len=256)
    eos = llm.tokenizer.eos_token_id
    plain, ignoring, user_stop, forced = llm.generate([PROMPT] * 4, [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[b]),
        SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100.0}),
    ], use_tqdm=False)
    assert plain["token_ids"] == greedy[:3] and (plain["finish_reason"], plain["stop_reason"]) == ("stop", a)
    assert ignoring["token_ids"] == greedy[:12] and ignoring["finish_reason"] == "length"
    assert user_stop["token_ids"] == greedy[:5] and user_stop["stop_reason"] == b  # the user's ids still stop it
    assert forced["token_ids"] == [eos] and forced["finish_reason"] == "stop"  # the tokenizer's EOS is an end token
    assert forced["stop_reason"] is None  # vLLM's rule: the EOS token is no stop reason; the config's ids are


def test_a_temperature_below_1e_5_is_greedy(llm: LLM, tiny_qwen3: Path) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=1e-6, seed=3, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(str(tiny_qwen3), tuple(PROMPT))[:8]


@pytest.mark.parametrize("penalty", [0.5, 1.8])
def test_greedy_with_a_repetition_penalty_matches_transformers(llm: LLM, tiny_qwen3: Path, penalty: float) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor has the same definition (prompt and output tokens). On
    this model 0.5 makes greedy repeat its own output tokens (counted on the device as they are sampled)."""
    prompt = synthetic_prompt(6, seed=3) * 3
    out = llm.generate([prompt], SamplingParams(temperature=0.0, repetition_penalty=penalty, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = _hf_model(str(tiny_qwen3)).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                                  min_new_tokens=12, do_sample=False, repetition_penalty=penalty,
                                                  pad_token_id=0)
    assert out["token_ids"] == ref[0, len(prompt):].tolist()
    if penalty < 1:
        assert out["token_ids"] != hf_greedy(str(tiny_qwen3), tuple(prompt), 12)


# ============================================================================ bad values
BAD_VALUES = [
    ("temperature", 1e308, "temperature must be a finite number in [0, 3.4e38]"),
    ("temperature", -0.1, "temperature"),
    ("top_p", 0.0, "top_p must be a finite number in (0, 1]"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k must be an integer >= 1, or 0 or -1 for off"),
    ("top_k", 2.5, "top_k"),
    ("min_p", 1.01, "min_p must be a finite number in [0, 1]"),
    ("presence_penalty", 2.5, "presence_penalty must be a finite number in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a number > 0"),
    ("repetition_penalty", 1e39, "repetition_penalty"),
    ("logit_bias", {5: 101.0}, "logit_bias[5] must be a finite number in [-100, 100]"),
    ("logit_bias", {-1: 1.0}, "logit_bias keys must be token ids"),
    ("logit_bias", [1, 2], "logit_bias must be a map"),
    ("bad_words", ["ok", ""], "bad_words must be a list of non-blank strings"),
    ("min_tokens", -1, "min_tokens must be an integer"),
    ("min_tokens", 100, "min_tokens must be in [0, max_tokens=64]"),
    ("max_tokens", 0, "max_tokens must be an integer in [1, 2**63)"),
    ("stop", ["ok", ""], "stop must be a non-empty string"),
    ("stop", "", "stop must be a non-empty string or a list of them: an empty string would match before any output "
                 "text (vLLM refuses it too), got ''"),
    ("stop", [""], "an empty string would match before any output text (vLLM refuses it too), got ['']"),
    ("stop", 5, "stop must be"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output must be true or false"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of integers"),
    ("ignore_eos", "yes", "ignore_eos must be true or false"),
    ("seed", -1, "seed must be an integer in [0, 2**63)"),
    ("skip_special_tokens", None, "skip_special_tokens must be true or false"),
    ("logprobs", 21, "logprobs must be an integer in [0, 20]"),
    ("prompt_logprobs", -1, "prompt_logprobs must be an integer in [0, 20]"),
    ("n", 0, "n must be an integer in [1, 2**31)"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_a_bad_value_of_any_field_is_refused_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert str(err.value).startswith(field) and message in str(err.value)


def test_bad_values_sent_over_the_wire_fail_their_own_request_only(llm: LLM) -> None:
    vocab = llm.config.vocab_size
    cases = [(f, v) for f, v, _ in BAD_VALUES if not isinstance(v, float) or v == v]  # NaN cannot be compared
    requests = [GenerateRequest(str(i), prompt="hi", sampling={"max_tokens": 4, field: value})
                for i, (field, value) in enumerate(cases)]
    requests += [GenerateRequest("vocab", prompt="hi", sampling={"logit_bias": {vocab: 1.0}}),
                 GenerateRequest("ok", prompt="hi", sampling={"max_tokens": 3, "top_p": 0.5, "n": 2})]
    client = EngineClient(llm.engine.endpoints.client)
    try:
        ipc.send(client.sock, Submit(requests))
        outs = {}
        while len(outs) < len(requests):
            outs.update({o.request_id: o for o in client.recv_outputs(timeout_s=30) if o.finished})
    finally:
        client.close()
    for i, (field, _) in enumerate(cases):
        assert outs[str(i)].finish_reason == "error" and outs[str(i)].error.startswith(field), (field, outs[str(i)])
    assert f"logit_bias keys must be token ids in [0, {vocab})" in outs["vocab"].error
    assert outs["ok"].error is None and [len(s.token_ids) for s in outs["ok"].outputs] == [3, 3]


@pytest.mark.parametrize(("argv", "message"), [
    (["--top-p", "2"], "--top-p must be a finite number in (0, 1]"),
    (["--top-k", "-5"], "--top-k must be an integer >= 1, or 0 or -1 for off"),
    (["--min-p", "-1"], "--min-p must be a finite number in [0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a number > 0"),
    (["--presence-penalty", "3"], "--presence-penalty must be a finite number in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty must be a finite number in [-2, 2]"),
    (["--n", "0"], "--n must be an integer in [1, 2**31)"),
    (["--logprobs", "30"], "--logprobs must be an integer in [0, 20]"),
    (["--min-tokens", "99"], "--min-tokens must be in [0, max_tokens=64]"),
    (["--stop", ""], "--stop must be a non-empty string"),
    (["--temperature", "1e308"], "--temperature must be a finite number in [0, 3.4e38]"),
    # xgrammar parses a regex or EBNF grammar without a tokenizer: no engine needs to answer first
    (["--regex", "([a"], "--regex: the regex cannot be compiled: Regex parsing error at position 4: Unclosed '['"),
    (["--grammar", "x"], '--grammar: the EBNF grammar cannot be compiled: EBNF parser error at line 1, column 1: '
                         'The root rule with name "root" is not found'),
])
def test_the_client_cli_refuses_a_bad_sampling_flag_by_name(argv: list[str], message: str, capsys) -> None:
    from frontend.client_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "hi"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err


@pytest.mark.parametrize(("argv", "message"), [
    (["--top-p", "0"], "--top-p must be a finite number in (0, 1]"),
    (["--n", "100000"], "--n must be at most --max-num-seqs (256)"),  # it started the engine, then failed
    (["--n", "9", "--max-num-seqs", "8"], "--n must be at most --max-num-seqs (8)"),
    (["--regex", "a{2,1}"], "--regex: the regex cannot be compiled: "),  # it started the engine, then failed
])
def test_launch_refuses_a_bad_sampling_flag_before_starting_an_engine(tiny_qwen3: Path, argv: list[str],
                                                                     message: str) -> None:
    result = subprocess.run([sys.executable, "launch.py", "--model", str(tiny_qwen3), "--prompt", "hi", *argv,
                             "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "engine ready" not in result.stderr


def test_the_cli_flags_reach_the_engine(llm: LLM, tiny_qwen3: Path, capsys) -> None:
    from frontend.client_cli import main

    code = main(["--address", llm.engine.endpoints.client, "--json", "--max-tokens", "5", "--n", "2", "--top-k",
                 "20", "--top-p", "0.9", "--min-p", "0.01", "--temperature", "0.8", "--seed", "4", "--logprobs", "2",
                 "--repetition-penalty", "1.1", "--presence-penalty", "0.1", "--frequency-penalty", "0.1",
                 "--min-tokens", "1", "--ignore-eos", "--stop", "never-there", "hi"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and len(row["outputs"]) == 2
    assert all(len(s["token_ids"]) == 5 and len(s["logprobs"]) == 5 for s in row["outputs"])
    direct = llm.generate(["hi"], SamplingParams(max_tokens=5, n=2, top_k=20, top_p=0.9, min_p=0.01, temperature=0.8,
                                                 seed=4, logprobs=2, repetition_penalty=1.1, presence_penalty=0.1,
                                                 frequency_penalty=0.1, min_tokens=1, ignore_eos=True,
                                                 stop=["never-there"]), use_tqdm=False)[0]
    assert [s["token_ids"] for s in row["outputs"]] == samples_of(direct)


def test_the_client_prints_answers_in_the_order_of_its_prompts(llm: LLM, capsys) -> None:
    """The empty prompt fails at once and the long request finishes last, yet the rows come in the prompts' order
    (a fresh user found them in completion order; launch.py keeps the prompts' order)."""
    from frontend.client_cli import main

    prompts = ["a request that runs for a while", "", "short"]
    code = main(["--address", llm.engine.endpoints.client, "--json", "--max-tokens", "3", "--ignore-eos", *prompts])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1  # one prompt failed
    assert [r["prompt"] for r in rows] == prompts
    assert rows[1]["finish_reason"] == "error" and rows[0]["finish_reason"] == rows[2]["finish_reason"] == "length"
