"""xgrammar against llguidance for structured outputs (CPU only, a few minutes).

    python benchmarks/grammar_libraries.py [--model DIR] [--tokenizer DIR] [--threads N]
        [--mode teacher|random|both] [--vocab demo|qwen3|both] [--library xgrammar|llguidance|both]
        [--schema 20|tool|both] [--steps N] [--seed S]

For each vocabulary (the built-in demo model's, SmolLM2-135M-Instruct, 49,152 tokens, and the Qwen3
tokenizer's at Qwen3-0.6B's 151,936 logits) and each library, with the same number of threads:

Teacher-forced (the tokens of one valid instance of `SCHEMA_20_FIELDS`, fed as a trained model would write it):
- compile: the time from a 20-field JSON schema (`SCHEMA_20_FIELDS`: nested object, arrays with
  min/max items, enums, bounded integers and numbers, strings with patterns and formats, optional and
  required fields) to a matcher ready for its first mask, the tokenizer's one-time set-up apart
  (median of 3, no cache); llguidance builds masks lazily, so most of its work is in the masks;
- mask at batch 1: the time to fill one row's token bitmask, for every token of the instance;
- mask at batch 64: the time to fill 64 rows' bitmasks at once (xgrammar's BatchGrammarMatcher,
  llguidance's fill_next_token_bitmask_par), the rows at 64 different positions of the instance,
  over 40 steps.

Random walk (what a random-weight model does: each row takes a uniformly random token among those its mask
allows, fixed seed, `--steps` tokens), for `SCHEMA_20_FIELDS` and `TOOL_CALL_SCHEMA` (no formats or patterns):
the batch fill of each step (mean, p50, p99, max), every matcher's fill alone, the slowest matcher of each
step against the step's matchers added up over the threads (a batch fill near the first is bounded by one
slow row; near the second, by the total work), and the fields whose masks cost most.

The numbers and the choice they led to are in workers/structured_output.py's docstring.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

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


# A tool call as a chat model emits it: objects, strings, integers, a number, enums, arrays, a boolean; no formats,
# no patterns, no length bounds (what most function-calling schemas look like).
TOOL_CALL_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["search_flights", "book_hotel", "get_weather"]},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string"},
                "destination": {"type": "string"},
                "date": {"type": "string"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]},
                "max_price": {"type": "number"},
                "airlines": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                "nonstop": {"type": "boolean"},
            },
            "required": ["origin", "destination", "date", "passengers"],
        },
    },
    "required": ["name", "arguments"],
}
SCHEMAS = {"20 fields": SCHEMA_20_FIELDS, "tool call": TOOL_CALL_SCHEMA}


class XgrammarRows:
    """`rows` xgrammar matchers of one JSON schema, compiled with the engine's options
    (workers/structured_output.py: any whitespace, at most MAX_JSON_WHITESPACE characters of it, strict mode),
    filled as a batch, and `rows` more fed the same tokens and filled one at a time (`alone`): a library may
    cache a mask until the next token, so the second fill of one matcher would time nothing."""

    def __init__(self, tokenizer, vocab_size: int, schema: dict, threads: int, rows: int) -> None:
        import xgrammar as xgr

        from workers.structured_output import MAX_JSON_WHITESPACE

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=True,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        self.matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        self.alone = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        self.batch = xgr.BatchGrammarMatcher(threads)

    def fill(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([self.matchers[i] for i in rows], bitmask, rows)

    def fill_one(self, bitmask: torch.Tensor, row: int) -> None:
        self.alone[row].fill_next_token_bitmask(bitmask, 0)

    def accept(self, row: int, token: int) -> bool:
        return self.matchers[row].accept_token(token) and self.alone[row].accept_token(token)

    def finished(self, row: int) -> bool:
        return self.matchers[row].is_terminated()


class LlguidanceRows:
    """`rows` llguidance matchers of one JSON schema, with xgrammar's bound on whitespace (at most
    MAX_JSON_WHITESPACE characters between two elements); `alone` as XgrammarRows'."""

    def __init__(self, tokenizer, vocab_size: int, schema: dict, threads: int, rows: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch  # noqa: F401  (torch.compile's machinery, seconds: not in the first timed fill)

        from workers.structured_output import MAX_JSON_WHITESPACE

        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        whitespace = rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": whitespace})
        self.matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
        self.alone = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
        assert not self.matchers[0].is_error(), self.matchers[0].get_error()
        self.executor = llguidance.LLExecutor(threads)

    def fill(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        import llguidance.torch as llt

        llt.fill_next_token_bitmask_par(self.executor, [(self.matchers[i], i) for i in rows], bitmask)

    def fill_one(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch as llt

        llt.fill_next_token_bitmask(self.alone[row], bitmask, 0)

    def accept(self, row: int, token: int) -> bool:
        return self.matchers[row].consume_token(token) and self.alone[row].consume_token(token)

    def finished(self, row: int) -> bool:
        return self.matchers[row].is_stopped()


def _property_names(schema: object) -> set[str]:
    if isinstance(schema, dict):
        names = set(schema.get("properties", {}))
        return names.union(*(_property_names(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_property_names(v) for v in schema))
    return set()


def random_walk(matchers, tokenizer, vocab_size: int, schema: dict, steps: int, seed: int) -> dict:
    """Decode `steps` tokens in every row, each a uniformly random token among those its mask allows (what a
    random-weight model samples), with a fixed seed. Each step times the batch fill (the library's batch API,
    as the worker calls it) and then every row's fill alone (the per-matcher distribution, on the row's twin
    matcher), which must give the same mask. Every per-matcher time is labelled with the field its row is in:
    the last property name followed by a colon in the row's text (before the first one: "{").

    Returns {"step_ms", "slowest_ms" (each step's slowest matcher), "sum_ms" (each step's matchers added up),
    "one_ms", "field", "allowed"} (the last three per matcher and step)."""
    width = (vocab_size + 31) // 32
    rows = len(matchers.matchers)
    key = re.compile('"(' + "|".join(sorted(map(re.escape, _property_names(schema)), key=len, reverse=True))
                     + r')"\s*:')
    rng = np.random.default_rng(seed)
    bitmask = torch.zeros((rows, width), dtype=torch.int32)
    one = torch.zeros((1, width), dtype=torch.int32)
    ids: list[list[int]] = [[] for _ in range(rows)]
    out: dict[str, list] = {"step_ms": [], "slowest_ms": [], "sum_ms": [], "one_ms": [], "field": [], "allowed": []}
    for _ in range(steps):
        live = [i for i in range(rows) if not matchers.finished(i)]
        if not live:
            break
        t0 = time.perf_counter()
        matchers.fill(bitmask, live)
        out["step_ms"].append((time.perf_counter() - t0) * 1e3)
        singles = []
        for i in live:
            t0 = time.perf_counter()
            matchers.fill_one(one, i)
            singles.append((time.perf_counter() - t0) * 1e3)
            assert torch.equal(one[0], bitmask[i]), "the batch fill and the fill of one row disagree"
        out["slowest_ms"].append(max(singles))
        out["sum_ms"].append(sum(singles))
        bits = np.unpackbits(bitmask.numpy()[live].view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        for j, i in enumerate(live):
            allowed = np.flatnonzero(bits[j])
            found = key.findall(tokenizer.decode(ids[i]))
            out["one_ms"].append(singles[j])
            out["field"].append(found[-1] if found else "{")
            out["allowed"].append(len(allowed))
            token = int(rng.choice(allowed))
            assert matchers.accept(i, token), f"the matcher refused the token {token} its own mask allowed"
            ids[i].append(token)
    return out


def _dist(values: list[float]) -> str:
    return (f"{statistics.mean(values):7.2f} {np.percentile(values, 50):7.2f} {np.percentile(values, 99):7.2f} "
            f"{max(values):7.2f}")


def print_random_walk(title: str, r: dict, threads: int, top: int = 6) -> None:
    """The walk's per-step and per-matcher times (mean, p50, p99, max, in ms) and its `top` costliest fields."""
    print(f"{title}: {len(r['step_ms'])} steps")
    print(f"  {'ms':<42} {'mean':>7} {'p50':>7} {'p99':>7} {'max':>7}")
    print(f"  {'batch fill (one step)':<42} {_dist(r['step_ms'])}")
    print(f"  {'one matcher alone':<42} {_dist(r['one_ms'])}")
    print(f"  {'slowest matcher of the step':<42} {_dist(r['slowest_ms'])}")
    print(f"  {f'matchers of the step added up / {threads} threads':<42} {_dist([t / threads for t in r['sum_ms']])}")
    fields: dict[str, list[int]] = {}
    for i, f in enumerate(r["field"]):
        fields.setdefault(f, []).append(i)
    worst = sorted(fields.items(), key=lambda kv: -sum(r["one_ms"][i] for i in kv[1]))[:top]
    total = sum(r["one_ms"])
    print(f"  {'field (costliest first)':<24} {'share':>6} {'fills':>6} {'mean ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'allowed':>8}")
    for name, idx in worst:
        t = [r["one_ms"][i] for i in idx]
        print(f"  {name:<24} {sum(t) / total:>6.0%} {len(t):>6} {statistics.mean(t):>8.2f} "
              f"{np.percentile(t, 99):>8.2f} {max(t):>8.2f} {statistics.mean(r['allowed'][i] for i in idx):>8.0f}")



def main() -> None:
    from transformers import AutoTokenizer

    from frontend.default_model import ensure_default_model
    from tests.conftest import qwen3_tokenizer_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="the demo model's folder (default: fetched and cached)")
    p.add_argument("--tokenizer", default=None, help="the Qwen3 tokenizer's folder (default: the tests' one)")
    p.add_argument("--threads", type=int, default=2, help="threads each library may use (2: this CI machine)")
    p.add_argument("--mode", choices=["teacher", "random", "both"], default="both",
                   help="teacher-forced masks, random walks, or both (default)")
    p.add_argument("--vocab", choices=["demo", "qwen3", "both"], default="both")
    p.add_argument("--library", choices=["xgrammar", "llguidance", "both"], default="both")
    p.add_argument("--schema", choices=["20", "tool", "both"], default="both", help="random walk: which schema")
    p.add_argument("--steps", type=int, default=100, help="random walk: tokens per row")
    p.add_argument("--seed", type=int, default=0, help="random walk: seed of the token choices")
    args = p.parse_args()
    vocabularies = [("SmolLM2-135M (demo)", lambda: args.model or ensure_default_model(), 49152),
                    ("Qwen3", lambda: args.tokenizer or str(qwen3_tokenizer_path()), 151936)]
    vocabularies = [v for v in vocabularies if args.vocab in ("both", "demo" if v[2] == 49152 else "qwen3")]
    libraries = [lib for lib in ("xgrammar", "llguidance") if args.library in ("both", lib)]
    tokenizers = {name: AutoTokenizer.from_pretrained(path()) for name, path, _ in vocabularies}
    if args.mode in ("teacher", "both"):
        text = json.dumps(INSTANCE_20_FIELDS)
        print("teacher-forced, the 20-field schema (the tokens of one valid instance):")
        print(f"{'vocabulary':<20} {'library':<11} {'set-up s':>8} {'compile ms':>10} "
              f"{'mask b=1 mean/p50/p99 us':>25} {'mask b=64 mean/p50 ms':>22}")
        for name, _, vocab_size in vocabularies:
            tokenizer = tokenizers[name]
            ids = tokenizer.encode(text, add_special_tokens=False)
            for library in libraries:
                r = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance}[library](
                    tokenizer, vocab_size, ids, args.threads)
                print(f"{name:<20} {library:<11} {r['setup_s']:>8.2f} {r['compile_s'] * 1e3:>10.1f} "
                      f"{r['mask1_mean_us']:>9.0f} / {r['mask1_p50_us']:>4.0f} / {r['mask1_p99_us']:>6.0f} "
                      f"{r['mask64_mean_ms']:>12.2f} / {r['mask64_p50_ms']:>6.2f}", flush=True)
    if args.mode in ("random", "both"):
        schemas = [(k, v) for k, v in SCHEMAS.items() if args.schema in ("both", k.split()[0][:4])]
        for name, _, vocab_size in vocabularies:
            for schema_name, schema in schemas:
                for library in libraries:
                    rows = {"xgrammar": XgrammarRows, "llguidance": LlguidanceRows}[library](
                        tokenizers[name], vocab_size, schema, args.threads, BATCH)
                    r = random_walk(rows, tokenizers[name], vocab_size, schema, args.steps, args.seed)
                    print_random_walk(f"\nrandom walk, {name}, the {schema_name} schema, {library}, batch {BATCH}, "
                                      f"{args.threads} threads, seed {args.seed}", r, args.threads)


if __name__ == "__main__":
    main()
