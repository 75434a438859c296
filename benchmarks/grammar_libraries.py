"""xgrammar against llguidance for structured outputs (CPU only, about a minute).

    python benchmarks/grammar_libraries.py [--model DIR] [--tokenizer DIR] [--threads N]

For each vocabulary (the built-in demo model's, SmolLM2-135M-Instruct, 49,152 tokens, and the Qwen3
tokenizer's at Qwen3-0.6B's 151,936 logits) and each library, with the same number of threads:

- compile: the time from a 20-field JSON schema (`SCHEMA_20_FIELDS`: nested object, arrays with
  min/max items, enums, bounded integers and numbers, strings with patterns and formats, optional and
  required fields) to a matcher ready for its first mask, the tokenizer's one-time set-up apart
  (median of 3, no cache); llguidance builds masks lazily, so most of its work is in the masks;
- mask at batch 1: the time to fill one row's token bitmask, for every token of a valid instance of
  the schema (the instance's own tokenization, fed to the matcher as a model would produce it);
- mask at batch 64: the time to fill 64 rows' bitmasks at once (xgrammar's BatchGrammarMatcher,
  llguidance's fill_next_token_bitmask_par), the rows at 64 different positions of the instance,
  over 40 steps.

The numbers and the choice they led to are in workers/structured_output.py's docstring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA_20_FIELDS: dict = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "created": {"type": "string", "format": "date"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "country": {"type": "string", "enum": ["FR", "DE", "US"]}},
                    "required": ["city", "country"]},
        "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"},
        "height_m": {"type": "number", "minimum": 0.3, "maximum": 2.8},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]}, "maxItems": 3},
        "manager_id": {"type": ["integer", "null"]},
        "website": {"type": "string", "format": "uri"},
        "notes": {"type": "string", "maxLength": 60},
        "level": {"type": "integer", "enum": [1, 2, 3]},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "uuid": {"type": "string", "format": "uuid"},
    },
    "required": ["id", "name", "email", "age", "active", "role", "tags", "address", "level", "created"],
    "additionalProperties": False,
}
INSTANCE_20_FIELDS: dict = {
    "id": 42, "name": "Ada Lovelace", "email": "ada@example.com", "age": 36, "score": 99.5, "active": True,
    "role": "admin", "tags": ["math", "poet"], "created": "1843-07-10", "zip": "75001",
    "address": {"street": "1 Rue X", "city": "Paris", "country": "FR"}, "phone": "+33123456789", "height_m": 1.65,
    "languages": ["en", "fr"], "manager_id": None, "website": "https://example.com/ada", "notes": "first programmer",
    "level": 3, "ratio": 0.5, "uuid": "123e4567-e89b-12d3-a456-426614174000",
}
BATCH = 64
STEPS = 40


def _allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def bench_xgrammar(tokenizer, vocab_size: int, ids: list[int], threads: int) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    setup = time.perf_counter() - t0
    compiles = []
    for _ in range(3):
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA_20_FIELDS))
        xgr.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - t0)
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab_size)
    matcher = xgr.GrammarMatcher(compiled)
    single = []
    for token in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        single.append(time.perf_counter() - t0)
        assert _allowed(bitmask.numpy(), 0, token), f"xgrammar masks {tokenizer.decode([token])!r}"
        assert matcher.accept_token(token)
    batch = xgr.BatchGrammarMatcher(threads)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    positions = [i * (len(ids) - STEPS) // BATCH for i in range(BATCH)]
    for m, p in zip(matchers, positions):
        assert all(m.accept_token(t) for t in ids[:p])
    steps = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        steps.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            assert m.accept_token(ids[positions[i]])
            positions[i] += 1
    return {"setup_s": setup, "compile_s": statistics.median(compiles), **_stats(single, steps)}


def bench_llguidance(tokenizer, vocab_size: int, ids: list[int], threads: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llnp

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - t0
    compiles = []
    for _ in range(3):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA_20_FIELDS,
                                                                 defaults={"whitespace_flexible": True})
        matcher = llguidance.LLMatcher(lltok, grammar)
        compiles.append(time.perf_counter() - t0)
        assert not matcher.is_error(), matcher.get_error()
    bitmask = llnp.allocate_token_bitmask(BATCH, vocab_size)
    single = []
    for token in ids:
        t0 = time.perf_counter()
        llnp.fill_next_token_bitmask(matcher, bitmask, 0)
        single.append(time.perf_counter() - t0)
        assert _allowed(bitmask, 0, token), f"llguidance masks {tokenizer.decode([token])!r}"
        assert matcher.consume_token(token), matcher.get_error()
    executor = llguidance.LLExecutor(threads)
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    positions = [i * (len(ids) - STEPS) // BATCH for i in range(BATCH)]
    for m, p in zip(matchers, positions):
        assert m.consume_tokens(ids[:p]) or p == 0
    steps = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        steps.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            assert m.consume_token(ids[positions[i]])
            positions[i] += 1
    return {"setup_s": setup, "compile_s": statistics.median(compiles), **_stats(single, steps)}


def _stats(single: list[float], steps: list[float]) -> dict[str, float]:
    return {"mask1_mean_us": statistics.mean(single) * 1e6, "mask1_p50_us": statistics.median(single) * 1e6,
            "mask1_p99_us": float(np.percentile(single, 99)) * 1e6, "mask64_mean_ms": statistics.mean(steps) * 1e3,
            "mask64_p50_ms": statistics.median(steps) * 1e3}


def main() -> None:
    from transformers import AutoTokenizer

    from frontend.default_model import ensure_default_model
    from tests.conftest import qwen3_tokenizer_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="the demo model's folder (default: fetched and cached)")
    p.add_argument("--tokenizer", default=None, help="the Qwen3 tokenizer's folder (default: the tests' one)")
    p.add_argument("--threads", type=int, default=2, help="threads each library may use (2: this CI machine)")
    args = p.parse_args()
    vocabularies = [("SmolLM2-135M (demo)", args.model or ensure_default_model(), 49152),
                    ("Qwen3", args.tokenizer or str(qwen3_tokenizer_path()), 151936)]
    text = json.dumps(INSTANCE_20_FIELDS)
    print(f"{'vocabulary':<20} {'library':<11} {'set-up s':>8} {'compile ms':>10} {'mask b=1 mean/p50/p99 us':>25} "
          f"{'mask b=64 mean/p50 ms':>22}")
    for name, path, vocab_size in vocabularies:
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for library, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            r = bench(tokenizer, vocab_size, ids, args.threads)
            print(f"{name:<20} {library:<11} {r['setup_s']:>8.2f} {r['compile_s'] * 1e3:>10.1f} "
                  f"{r['mask1_mean_us']:>9.0f} / {r['mask1_p50_us']:>4.0f} / {r['mask1_p99_us']:>6.0f} "
                  f"{r['mask64_mean_ms']:>12.2f} / {r['mask64_p50_ms']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
