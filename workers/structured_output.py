"""Structured outputs on a worker: grammars compiled off the step loop, one matcher per constrained request,
and the token bitmask of a step's constrained rows.

Libraries: llguidance (github.com/guidance-ai/llguidance, its docs/optimizations.md: an Earley parser over
lexemes, each mask a walk of the token trie through the lexer's lazily built DFA) for JSON schemas and JSON
objects, and xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models", 2024: a pushdown automaton whose context-independent tokens are precomputed per grammar
position, the others checked at run time) for regex, choice and EBNF; `backend="xgrammar"`
(`structured_outputs_backend`) puts JSON on xgrammar too. `benchmarks/grammar_libraries.py` measured both on this
project's 2-core CI machine (2 threads each, a busy host), on the Qwen3 vocabulary (151,936), batch 64, ms per
step of the batch fill (mean / p50 / p99 / max):

    schema, tokens                          xgrammar                          llguidance
    20 fields, teacher-forced               2.16 /   2.11                     4.26 /  3.79
    20 fields, random walk (100 steps)     76.57 / 106.10 / 206.9 / 207.0     6.25 /  3.31 /  36.0 /  36.4
    tool call, random walk (100 steps)      3.21 /   3.25 /   8.0 /  11.5     1.77 /  1.09 /   5.9 /   6.6

(20 fields: `SCHEMA_20_FIELDS`, nested object, bounded arrays, enums, bounded numbers, patterns, formats; tool
call: `TOOL_CALL_SCHEMA`, objects, strings, integers, enums, arrays, no formats. Teacher-forced: the tokens of
one valid instance, what a trained model writes. Random walk: each row takes a uniformly random token among
those allowed, what a random-weight model does, so rows stay inside long strings.)

Where xgrammar's time goes on the random walk: 99% of it is in rows inside the `email` format, whose local part
(a right-recursive rule, the quoted form `\\"...\\"` most of all) leaves tens of thousands of tokens to check at
run time, each check costing more as the string grows: one matcher alone reached 86 ms a step, against 0.05 ms in
an unbounded plain string. Thread load-imbalance is a smaller part (the batch took 77 ms a step on average, its
slowest matcher 27 ms, its matchers added up over 2 threads 43 ms), and our code none (the time is inside
`batch_fill_next_token_bitmask`). llguidance's lexer turns every string, format and pattern into a DFA, so a
mask costs about the same whatever the string's length: its costliest rows were in a `maxLength` string (0.33 ms
mean, 4.1 ms max, when new DFA states are built). A trained model closes its strings, where xgrammar is twice as
fast; but one slow row bounds the whole step, and xgrammar's worst case grows without bound while llguidance's
stays within a few milliseconds: hence llguidance for JSON. In the engine on CPU (a tiny random model, 64 rows,
200 tokens) llguidance's masks took 5.6 ms a step (p99 35) for the 20-field schema and 2.1 ms (p99 8.7) for the
tool call. Regex, choice and EBNF stay on xgrammar (its EBNF dialect is the documented one). A JSON grammar of
llguidance costs about 2 ms to compile (xgrammar's 100 ms) and a request's matcher is a copy of a compiled one
(microseconds). llguidance's JSON token slices (`LLTokenizer.json_slices`) changed nothing measurable.

Who owns the matchers: the worker. It sits next to the logits and already holds every request's tokens,
so each matcher advances with the tokens the worker itself records, and nothing new crosses a socket per
step; the scheduler would have had to ship a mask of vocab/8 bytes per constrained row per step (19 KB
for Qwen3) in every plan. The scheduler keeps only the book of which grammars are compiled
(scheduler_proc/grammar_cache.py) and admits a request once every rank has compiled its grammar.

Compilation runs in one daemon thread per worker (`CompileGrammars` in, a `GrammarCompiled` per grammar
out, sent from that thread on a socket of its own), so the step loop never waits for it; xgrammar's
compiler uses several threads inside one compilation, and releases the GIL while it works. The
tokenizer and each library's view of it (xgrammar's `TokenizerInfo`, llguidance's `LLTokenizer`, about a
second each for Qwen3) are made in that thread: on CUDA at start-up (`preload`: building them holds the GIL,
which on the first constrained request stopped every other request's step for up to 2 s), on the CPU on the
first grammar that needs them, so that an engine that never sees a constrained request pays nothing there. A
step's masks: xgrammar's rows with its BatchGrammarMatcher, then llguidance's with its LLExecutor, each with
`threads` threads (default_threads).

Pipelining: the worker launches step N+1 before step N's tokens reach the host, but a constrained row's
mask for N+1 depends on its token from N. So when step N+1 has constrained rows, the worker launches
N+1's forward first, then waits for step N's tokens (`ModelRunner.receive`: already queued on the device
before that forward), advances the matchers with them, fills N+1's bitmask on the host while the device
runs the forward, copies it up and launches the sampling. The device waits only when waiting for N's
tokens plus filling the masks takes longer than N+1's forward (about 2 ms at batch 64 on an H200 for the
Qwen3-0.6B shape: the budget of `benchmarks/structured_output.py`); steps without constrained rows are not
touched. Step N's result goes to the scheduler as soon as its tokens are received, before N+1's masks are
filled, so that the plan of N+2 is made meanwhile and waits for the worker when N+1's sampling is launched.
(Cost of the wait itself: the host cannot prepare anything else meanwhile, but the next plan
is not there yet either: the worker would be idle otherwise.)

Tensor parallelism: every rank compiles every grammar and keeps its own matchers, fed the same tokens
(every rank samples the same token for a whole-vocabulary row), so every rank builds the same mask with
no collective; the alternative, rank 0 broadcasting its bitmask, would add a collective per step and
make the other ranks wait for rank 0's CPU.

Reasoning (vLLM's default with a reasoning parser): a chat request's grammar may apply only to the answer after
the model's reasoning. The frontend, which knows the prompt and the parser, sets `SamplingOptions`'
`reasoning_end_token_id` (`</think>`) and, for a model that decides whether it thinks (Qwen3),
`reasoning_start_token_id` (`<think>`). The request's matcher then sits out: while the output is in the
reasoning its rows allow every token and its tokens do not reach the library; the token after the end tag is
the grammar's first. With a start token, the grammar holds from the first output token, whose mask also allows
the start tag: sampling it opens the reasoning, any other token begins the answer. No library keeps such a
switch, so `RequestGrammar` keeps it beside the library's matcher.

After the grammar is complete, only the model's end tokens are allowed; a request that goes on anyway
(`ignore_eos`) keeps drawing end tokens. A request stopped by max_tokens is checked once, after its last token
(`RequestGrammar.accepting`): the scheduler names it in the plan of that step, and rank 0 reports whether its
output was left incomplete (`StepResult.grammar_incomplete_seq_ids`), which the client sees beside finish reason
"length". A token the matcher refuses (possible only when another parameter,
bad_words or min_tokens, banned every token the grammar allowed) fails its request (`StepResult.failed`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from common.config import STRUCTURED_OUTPUTS_BACKENDS
from common.protocol import CompileGrammars, GrammarCompiled, GrammarSpec

log = logging.getLogger("deltaserve.worker")
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Whitespace characters allowed between two JSON elements (any_whitespace): enough for pretty-printed JSON
# nested 4 levels deep, and a bound on the runs of spaces and newlines a small model repeats until max_tokens.
MAX_JSON_WHITESPACE = 20
WHAT_FAILS = {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
              "choice": "the choices", "grammar": "the EBNF grammar"}
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


_PRELOAD = object()  # a compile-thread message: build the tokenizer views (StructuredOutputManager.preload)


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row's token bitmask (bit t % 32 of word t // 32 is token t: 1 = allowed)."""
    return (vocab_size + 31) // 32


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are xgrammar's literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def library_error(exc: BaseException, limit: int = 600) -> str:
    """A grammar library's error as one line: xgrammar's without its timestamp and C++ source location, every
    line kept (llguidance's regex errors name the problem on their last lines: "regex parse error: ... error:
    unclosed group"), at most `limit` characters."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    text = " ".join([_LIBRARY_PREFIX.sub("", lines[0]).strip(), *lines[1:]])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def syntax_error(kind: str, spec: str) -> str | None:
    """Why xgrammar refuses a regex (`kind` "regex") or an EBNF grammar ("grammar") on its syntax alone, in the
    words a worker would use, or None. Needs no tokenizer, so the command line checks `--regex` and
    `--grammar` with it before starting an engine; None too where xgrammar cannot be imported (the engine then
    says why)."""
    try:
        import xgrammar
    except ImportError:
        return None
    parse = xgrammar.Grammar.from_regex if kind == "regex" else xgrammar.Grammar.from_ebnf
    try:
        parse(spec)
    except Exception as exc:  # xgrammar raises RuntimeError, and others for some inputs
        return f"{WHAT_FAILS.get(kind, 'the constraint')} cannot be compiled: {library_error(exc)}"
    return None


class RequestGrammar:
    """One constrained request's matcher: where its output stands in its grammar. It advances with every
    token that reaches the host (`StructuredOutputManager.accept`). `guidance`: an llguidance `LLMatcher`,
    else an xgrammar `GrammarMatcher`.

    `reasoning_end`, `reasoning_start` (token ids, -1: none): the grammar waits for the end of the reasoning (see
    the module's docstring): `thinking` while the output is in it, `may_open` before the first token when that
    token may open it."""

    __slots__ = ("matcher", "grammar_id", "guidance", "error", "reasoning_end", "reasoning_start", "thinking",
                 "may_open")

    def __init__(self, matcher: Any, grammar_id: int, guidance: bool = False, reasoning_end: int = -1,
                 reasoning_start: int = -1) -> None:
        self.matcher = matcher
        self.grammar_id = grammar_id
        self.guidance = guidance
        self.error: str | None = None  # set once the matcher refused a token: the request fails with it
        self.reasoning_end = reasoning_end
        self.reasoning_start = reasoning_start
        self.may_open = reasoning_end >= 0 and reasoning_start >= 0
        self.thinking = reasoning_end >= 0 and reasoning_start < 0

    def takes_reasoning_token(self, token: int) -> bool:
        """Whether `token` belongs to the reasoning (and so not to the grammar): every token inside it, its end
        tag included, and a start tag that opens it as the first token."""
        if self.thinking:
            self.thinking = token != self.reasoning_end
            return True
        if self.may_open:
            self.may_open = False
            self.thinking = token == self.reasoning_start
            return self.thinking
        return False

    def complete(self) -> bool:
        """The grammar is complete: only end tokens may follow (xgrammar: one was accepted; llguidance: nothing
        but one can be)."""
        return self.matcher.is_stopped() if self.guidance else self.matcher.is_terminated()

    def accepting(self) -> bool:
        """The output so far is a whole sentence of the grammar, which may end here (a closed JSON value, a full
        match of the regex or a choice), though it might also go on ("12" of `[0-9]+`); False once the matcher
        refused a token. Read for a request that stops at max_tokens: False means its text does not match."""
        if self.error is not None:
            return False
        if self.guidance:
            return self.matcher.is_accepting()
        return self.matcher.is_completed() or self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles a worker's grammars in a background thread and makes and advances their matchers.

    `tokenizer_dir`: the model's tokenizer; `vocab_size`: the LM head's (>= the tokenizer's; the extra ids are
    never allowed); `end_token_ids`: the tokens allowed once a grammar is complete: the model's end tokens, as
    the frontend stops on them (generation_config.json's, to which the tokenizer's EOS is added);
    `report`: called from the compile thread with each `GrammarCompiled` (it must not share a socket with the
    step loop); `threads`: each library's threads for one compilation and for a step's masks; `backend`:
    "auto" (JSON schemas and JSON objects with llguidance, the rest with xgrammar) or "xgrammar" (everything).
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int, end_token_ids: list[int], rank: int,
                 report: Callable[[GrammarCompiled], None], threads: int, pin_memory: bool = False,
                 backend: str = "auto") -> None:
        if backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, got {backend!r}")
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.end_token_ids = sorted({t for t in end_token_ids if 0 <= t < vocab_size})
        self.rank = rank
        self.report = report
        self.threads = max(1, threads)
        self.pin_memory = pin_memory
        self.backend = backend
        # grammar id -> xgrammar CompiledGrammar, or an llguidance LLMatcher at the grammar's start (copied for
        # each request); written by the compile thread
        self.compiled: dict[int, Any] = {}
        self._tokenizer: Any = None  # the Hugging Face tokenizer; made by the compile thread on the first grammar
        self._compiler: Any = None  # xgrammar's, made by the compile thread on the first grammar it compiles
        self._lltokenizer: Any = None  # llguidance's view of the tokenizer, likewise
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher
        self._executor: Any = None  # llguidance's LLExecutor
        self._bitmask: torch.Tensor | None = None  # host [rows, width] int32, grown on demand
        self._end_mask: np.ndarray | None = None  # [width] int32: only the end tokens
        self._queue: queue.Queue[CompileGrammars | object | None] = queue.Queue()  # or _PRELOAD
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ compilation (background thread)
    def compile(self, msg: CompileGrammars) -> None:
        """Queue `msg`'s grammars for compilation and its forgotten ones for dropping; returns at once."""
        if not msg.grammars and not len(msg.forget_ids):
            return
        self._put(msg)

    def preload(self) -> None:
        """Build, in the compile thread, the tokenizer views the backend's libraries need (the Hugging Face
        tokenizer, xgrammar's `TokenizerInfo` and compiler, with backend "auto" llguidance's `LLTokenizer`) now
        rather than on the first constrained request; returns at once.

        Building them holds the GIL (on the Qwen3 vocabulary, on the CI machine: llguidance's view 1.27 s, 0.79 s
        at a stretch; xgrammar's 0.48 s; the tokenizer 0.28 s), so built on the first constrained request they
        stopped the step loop of every other request: a 1,951 ms prefill step in `benchmarks/throughput.py --mix
        chat` on an H200 (2026-12-05), whose first JSON request came mid-run. The worker calls this at start-up on
        CUDA, where that stall is 300 decode steps. A library that cannot be imported, or a tokenizer it cannot
        read, is left for the first request that needs it to report, as without a preload."""
        self._put(_PRELOAD)

    def _put(self, msg: CompileGrammars | object) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_loop, name="grammar-compiler", daemon=True)
            self._thread.start()
        self._queue.put(msg)

    def _build_views(self) -> None:
        try:
            if self._compiler is None:
                self._make_compiler()
            if self.backend == "auto" and self._lltokenizer is None:
                self._make_lltokenizer()
        except SetupError:
            pass

    def _compile_loop(self) -> None:
        # Messages are handled in order, so a grammar forgotten while this rank still compiled it (another rank
        # failed it) is dropped after it was stored, never stored after it was dropped.
        while (msg := self._queue.get()) is not None:
            if msg is _PRELOAD:
                self._build_views()
                continue
            for gid in msg.forget_ids.tolist():
                self.compiled.pop(gid, None)
            for item in msg.grammars:
                t0 = time.perf_counter()
                error = None
                try:
                    self.compiled[item.grammar_id] = self._compile(item.grammar)
                except Exception as exc:  # a bad schema, regex or grammar (xgrammar: RuntimeError), a set-up failure
                    error = f"structured_outputs.{item.grammar.kind}: {self._why(item.grammar, exc)}"
                self.report(GrammarCompiled(self.rank, item.grammar_id, error, time.perf_counter() - t0))

    def _why(self, grammar: GrammarSpec, exc: BaseException) -> str:
        if isinstance(exc, SetupError):
            return str(exc)
        return f"{WHAT_FAILS.get(grammar.kind, 'the constraint')} cannot be compiled: {library_error(exc)}"

    def uses_guidance(self, kind: str) -> bool:
        """Whether a constraint of this kind gets an llguidance matcher (else an xgrammar one)."""
        return self.backend == "auto" and kind in ("json", "json_object")

    def _compile(self, g: GrammarSpec) -> Any:
        if self.uses_guidance(g.kind):
            return self._compile_guidance(g)
        compiler = self._compiler or self._make_compiler()
        # Without any whitespace, no whitespace at all: xgrammar's own separators would be ", " and ": ".
        separators = None if g.any_whitespace else (",", ":")
        if g.kind == "json":
            return compiler.compile_json_schema(g.spec, any_whitespace=g.any_whitespace, strict_mode=True,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE, separators=separators)
        if g.kind == "json_object":
            return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=g.any_whitespace,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE, separators=separators)
        if g.kind == "regex":
            return compiler.compile_regex(g.spec)
        if g.kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(g.spec)))
        if g.kind == "grammar":
            return compiler.compile_grammar(g.spec)
        raise SetupError(f"unknown kind {g.kind!r}")

    def _compile_guidance(self, g: GrammarSpec) -> Any:
        """An llguidance matcher at the start of a JSON schema (or of any JSON object), with xgrammar's strict
        mode (no properties beyond those listed, `strict_schema`) and the same whitespace rule: at most
        MAX_JSON_WHITESPACE characters between two elements, or none. Raises `GrammarError` for a schema
        llguidance refuses."""
        import llguidance

        lltok = self._lltokenizer or self._make_lltokenizer()
        schema = strict_schema(json.loads(g.spec)) if g.kind == "json" else json.loads(JSON_OBJECT_SCHEMA)
        options: dict[str, Any] = ({"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
                                   if g.any_whitespace else {"whitespace_flexible": False})
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)  # refusals are ours to report, not stderr's
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            except Exception as exc:  # transformers raises several types for a tokenizer it cannot read
                raise self._unusable(exc) from None
            eos = self._tokenizer.eos_token_id
            if eos is not None and eos < self.vocab_size:
                self.end_token_ids = sorted({*self.end_token_ids, int(eos)})
        return self._tokenizer

    def _unusable(self, exc: BaseException) -> SetupError:
        return SetupError(f"the tokenizer in {self.tokenizer_dir} cannot be used for structured outputs: "
                          f"{type(exc).__name__}: {library_error(exc)}")

    def _make_compiler(self) -> Any:
        try:
            import xgrammar as xgr
        except ImportError as exc:
            raise SetupError(f"structured outputs need the xgrammar package, which cannot be imported here "
                             f"({exc}): pip install xgrammar") from None
        tokenizer = self._load_tokenizer()
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.end_token_ids or None)
        except Exception as exc:  # xgrammar raises several types for a tokenizer it cannot read
            raise self._unusable(exc) from None
        self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
        return self._compiler

    def _make_lltokenizer(self) -> Any:
        try:
            import llguidance.hf
        except ImportError as exc:
            raise SetupError(f"JSON structured outputs need the llguidance package, which cannot be imported here "
                             f"({exc}): pip install llguidance") from None
        tokenizer = self._load_tokenizer()
        try:
            self._lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                             eos_token=self.end_token_ids or None)
        except Exception as exc:  # a slow (Python) tokenizer, one llguidance cannot read
            raise self._unusable(exc) from None
        return self._lltokenizer

    def close(self) -> None:
        """Stop the compile thread (a compilation under way is abandoned with the daemon thread)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=1.0)

    @property
    def idle(self) -> bool:
        """No compilation is queued or running (so the compile thread's socket may be closed)."""
        return self._thread is None or not self._thread.is_alive()

    # ------------------------------------------------------------------ matchers (step loop)
    def new_grammar(self, grammar_id: int, reasoning_end: int = -1, reasoning_start: int = -1) -> RequestGrammar:
        """A matcher at the start of grammar `grammar_id`, which this rank has compiled (the scheduler admits a
        request only then), waiting for the end of the reasoning as `reasoning_end` and `reasoning_start` say
        (`SamplingOptions`' token ids; -1: none). Raises `KeyError` for a grammar it has not (a protocol bug)."""
        compiled = self.compiled.get(grammar_id)
        if compiled is None:
            raise KeyError(f"grammar {grammar_id} is not compiled on rank {self.rank}")
        if hasattr(compiled, "deep_copy"):  # an llguidance matcher: its copy costs microseconds, a new one ms
            return RequestGrammar(compiled.deep_copy(), grammar_id, True, reasoning_end, reasoning_start)
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), grammar_id, False, reasoning_end, reasoning_start)

    def accept(self, grammars: list[RequestGrammar], tokens: list[int]) -> dict[int, str]:
        """Advance each matcher by its token (one call into xgrammar for all of its matchers). Returns {index in
        `grammars`: error} for the tokens refused; a matcher already complete ignores its token (the end tokens
        that follow it when the request ignores EOS), and one that refused a token before ignores every later
        one. A token of the reasoning (`RequestGrammar.takes_reasoning_token`) does not reach the matcher."""
        todo = [i for i, g in enumerate(grammars)
                if g.error is None and not g.complete() and not g.takes_reasoning_token(tokens[i])]
        xgr_rows = [i for i in todo if not grammars[i].guidance]
        refused = [i for i in todo if grammars[i].guidance and not grammars[i].matcher.consume_token(tokens[i])]
        if xgr_rows:
            import xgrammar as xgr

            accepted = xgr.BatchGrammarMatcher.batch_accept_token([grammars[i].matcher for i in xgr_rows],
                                                                  [tokens[i] for i in xgr_rows])
            refused += [i for i, ok in zip(xgr_rows, accepted) if not ok]
        errors = {}
        for i in refused:
            g = grammars[i]
            g.error = (f"structured_outputs: the token sampled ({tokens[i]}) is outside the grammar: another "
                       "parameter (bad_words, min_tokens) banned every token the grammar allowed there")
            errors[i] = g.error
        return errors

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> torch.Tensor:
        """The next-token bitmask of each of `grammars`: `[G, width]` int32 on the host (pinned on CUDA), in a
        buffer reused by the next call. A complete grammar allows only the end tokens; a matcher that refused
        a token allows every token (its request is failing), and so does one inside the reasoning; before a
        first token that may open the reasoning, its start tag is allowed beside the grammar's tokens. Each
        library fills its rows with `threads` threads, xgrammar's first."""
        width = bitmask_width(self.vocab_size)
        n = len(grammars)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            size = max(n, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = torch.empty((size, width), dtype=torch.int32, pin_memory=self.pin_memory)
        bitmask = self._bitmask[:n]
        xgr_rows: list[int] = []
        guidance_rows: list[int] = []
        for i, g in enumerate(grammars):
            if g.error is not None or g.thinking:
                bitmask[i] = -1
            elif g.complete():
                bitmask[i] = torch.from_numpy(self._end_tokens_mask())
            else:
                (guidance_rows if g.guidance else xgr_rows).append(i)
        if xgr_rows:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher(self.threads)
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in xgr_rows], bitmask, xgr_rows)
        if guidance_rows:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(self.threads)
            # llguidance writes row i at data_ptr + i * width * 4 (it checks i < n); `bitmask` is contiguous
            self._executor.unsafe_compute_mask_ptr([(grammars[i].matcher, i) for i in guidance_rows],
                                                   bitmask.data_ptr(), width * 4, n)
        opening = [(i, g.reasoning_start) for i, g in enumerate(grammars) if g.may_open and g.error is None]
        if opening:
            words = bitmask.numpy().view(np.uint32)
            for i, token in opening:
                words[i, token >> 5] |= np.uint32(1 << (token & 31))
        return bitmask

    def _end_tokens_mask(self) -> np.ndarray:
        if self._end_mask is None:
            mask = np.zeros(bitmask_width(self.vocab_size) * 32, dtype=np.uint8)
            mask[self.end_token_ids] = 1
            self._end_mask = np.packbits(mask, bitorder="little").view(np.int32)
        return self._end_mask


def strict_schema(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` in every object schema that does not set it (xgrammar's
    strict mode: only the listed properties), wherever a subschema can stand (properties, items, anyOf, $defs,
    ...), never inside `enum`, `const` or `default` values. Returns a new object; `schema` is left as it is."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = strict_schema(out[key])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# Keywords whose value is a map of name -> subschema, and those whose value is a subschema or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "contains", "not", "if", "then", "else", "anyOf", "allOf",
               "oneOf", "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalProperties")


class GrammarError(RuntimeError):
    """A constraint the library refuses (its reason is the message)."""


class SetupError(RuntimeError):
    """Structured outputs cannot work on this worker at all (no xgrammar, an unusable tokenizer)."""


def default_threads(tp_size: int) -> int:
    """xgrammar threads for a worker: its share of this host's cores among the `tp_size` workers, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // max(1, tp_size)))


def apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`x` `[G, V]` float32 with every token whose bit is 0 in `bitmask` `[G, ceil(V / 32)]` int32 at -inf.

    The int32 words, read as little-endian bytes, hold token t at bit t % 8 of byte t // 8, so the bits
    unpack from bytes with one shift and one mask (1 byte per token in between, 4 times less than from
    int32 words); on CUDA the caller compiles this into one kernel."""
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    bits = (bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [G, 4 * width, 8]
    allowed = bits.view(bitmask.shape[0], -1)[:, : x.shape[1]]
    return x.masked_fill(allowed == 0, float("-inf"))
