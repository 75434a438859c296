"""Structured outputs on a worker: grammars compiled off the step loop, one matcher per constrained request,
and the token bitmask of a step's constrained rows.

Library: xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models", 2024; xgrammar.mlc.ai). `benchmarks/grammar_libraries.py` measured it against llguidance
on this project's 2-core CI machine (2 threads each, a busy host), with a 20-field JSON schema (nested
object, bounded arrays, enums, bounded numbers, patterns, formats, optional fields):

    vocabulary             library     compile     mask, batch 1 (mean / p50)   mask, batch 64 (mean / p50)
    SmolLM2-135M (49,152)  xgrammar     56 ms        5 us /  2 us                0.87 ms / 0.32 ms
    SmolLM2-135M (49,152)  llguidance    3 ms       50 us / 15 us                7.25 ms / 4.67 ms
    Qwen3 (151,936)        xgrammar    141 ms       64 us /  2 us                3.53 ms / 2.48 ms
    Qwen3 (151,936)        llguidance    6 ms      131 us / 18 us               14.12 ms / 13.80 ms

llguidance compiles almost nothing ahead and builds masks lazily; xgrammar precomputes the context-
independent tokens of every grammar position, so its masks are 4 to 10 times faster, and a mask is on the
path of every decode step while a compilation happens once per schema, off the step loop and cached. Hence
xgrammar. (One-time set-up per vocabulary: 0.2 s and 0.9 s for xgrammar, 0.6 s and 2.3 s for llguidance.)

Who owns the matchers: the worker. It sits next to the logits and already holds every request's tokens,
so each matcher advances with the tokens the worker itself records, and nothing new crosses a socket per
step; the scheduler would have had to ship a mask of vocab/8 bytes per constrained row per step (19 KB
for Qwen3) in every plan. The scheduler keeps only the book of which grammars are compiled
(scheduler_proc/grammar_cache.py) and admits a request once every rank has compiled its grammar.

Compilation runs in one daemon thread per worker (`CompileGrammars` in, a `GrammarCompiled` per grammar
out, sent from that thread on a socket of its own), so the step loop never waits for it; xgrammar's
compiler uses several threads inside one compilation, and releases the GIL while it works. The
tokenizer and xgrammar's view of it (`TokenizerInfo`, about a second for Qwen3) are made on the first
grammar, in that thread: an engine that never sees a constrained request pays nothing.

Pipelining: the worker launches step N+1 before step N's tokens reach the host, but a constrained row's
mask for N+1 depends on its token from N. So when step N+1 has constrained rows, the worker launches
N+1's forward first, then waits for step N's tokens (`ModelRunner.receive`: already queued on the device
before that forward), advances the matchers with them, fills N+1's bitmask on the host while the device
runs the forward, copies it up and launches the sampling. The device waits only when waiting for N's
tokens plus filling the masks takes longer than N+1's forward; steps without constrained rows are not
touched. (Cost of the wait itself: the host cannot prepare anything else meanwhile, but the next plan
is not there yet either: the worker would be idle otherwise.)

Tensor parallelism: every rank compiles every grammar and keeps its own matchers, fed the same tokens
(every rank samples the same token for a whole-vocabulary row), so every rank builds the same mask with
no collective; the alternative, rank 0 broadcasting its bitmask, would add a collective per step and
make the other ranks wait for rank 0's CPU.

After the grammar is complete, only the model's end tokens are allowed; a request that goes on anyway
(`ignore_eos`) keeps drawing end tokens. A token the matcher refuses (possible only when another parameter,
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

from common.protocol import CompileGrammars, GrammarCompiled, GrammarSpec

log = logging.getLogger("deltaserve.worker")
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Whitespace characters allowed between two JSON elements (any_whitespace): enough for pretty-printed JSON
# nested 4 levels deep, and a bound on the runs of spaces and newlines a small model repeats until max_tokens.
MAX_JSON_WHITESPACE = 20
WHAT_FAILS = {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
              "choice": "the choices", "grammar": "the EBNF grammar"}
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row's token bitmask (bit t % 32 of word t // 32 is token t: 1 = allowed)."""
    return (vocab_size + 31) // 32


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are xgrammar's literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def library_error(exc: BaseException) -> str:
    """The first line of an xgrammar error, without its timestamp and C++ source location."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return _LIBRARY_PREFIX.sub("", lines[0]).strip()


class RequestGrammar:
    """One constrained request's matcher: where its output stands in its grammar. It advances with every
    token that reaches the host (`StructuredOutputManager.accept`)."""

    __slots__ = ("matcher", "grammar_id", "error")

    def __init__(self, matcher: Any, grammar_id: int) -> None:
        self.matcher = matcher
        self.grammar_id = grammar_id
        self.error: str | None = None  # set once the matcher refused a token: the request fails with it


class StructuredOutputManager:
    """Compiles a worker's grammars in a background thread and makes and advances their matchers.

    `tokenizer_dir`: the model's tokenizer; `vocab_size`: the LM head's (>= the tokenizer's; the extra ids are
    never allowed); `end_token_ids`: the tokens allowed once a grammar is complete: the model's end tokens, as
    the frontend stops on them (generation_config.json's, to which the tokenizer's EOS is added);
    `report`: called from the compile thread with each `GrammarCompiled` (it must not share a socket with the
    step loop); `threads`: xgrammar's threads for one compilation and for a step's masks.
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int, end_token_ids: list[int], rank: int,
                 report: Callable[[GrammarCompiled], None], threads: int, pin_memory: bool = False) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.end_token_ids = sorted({t for t in end_token_ids if 0 <= t < vocab_size})
        self.rank = rank
        self.report = report
        self.threads = max(1, threads)
        self.pin_memory = pin_memory
        self.compiled: dict[int, Any] = {}  # grammar id -> xgrammar CompiledGrammar; written by the compile thread
        self._compiler: Any = None  # made by the compile thread on the first grammar
        self._batch: Any = None
        self._bitmask: torch.Tensor | None = None  # host [rows, width] int32, grown on demand
        self._end_mask: np.ndarray | None = None  # [width] int32: only the end tokens
        self._queue: queue.Queue[CompileGrammars | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ compilation (background thread)
    def compile(self, msg: CompileGrammars) -> None:
        """Queue `msg`'s grammars for compilation and its forgotten ones for dropping; returns at once."""
        if not msg.grammars and not len(msg.forget_ids):
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_loop, name="grammar-compiler", daemon=True)
            self._thread.start()
        self._queue.put(msg)

    def _compile_loop(self) -> None:
        # Messages are handled in order, so a grammar forgotten while this rank still compiled it (another rank
        # failed it) is dropped after it was stored, never stored after it was dropped.
        while (msg := self._queue.get()) is not None:
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

    def _compile(self, g: GrammarSpec) -> Any:
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

    def _make_compiler(self) -> Any:
        try:
            import xgrammar as xgr
        except ImportError as exc:
            raise SetupError(f"structured outputs need the xgrammar package, which cannot be imported here "
                             f"({exc}): pip install xgrammar") from None
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            if tokenizer.eos_token_id is not None and tokenizer.eos_token_id < self.vocab_size:
                self.end_token_ids = sorted({*self.end_token_ids, int(tokenizer.eos_token_id)})
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.end_token_ids or None)
        except Exception as exc:  # transformers and xgrammar raise several types for a tokenizer they cannot read
            raise SetupError(f"the tokenizer in {self.tokenizer_dir} cannot be used for structured outputs: "
                             f"{type(exc).__name__}: {library_error(exc)}") from None
        self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
        return self._compiler

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
    def new_grammar(self, grammar_id: int) -> RequestGrammar:
        """A matcher at the start of grammar `grammar_id`, which this rank has compiled (the scheduler admits a
        request only then). Raises `KeyError` for a grammar it has not (a protocol bug)."""
        import xgrammar as xgr

        compiled = self.compiled.get(grammar_id)
        if compiled is None:
            raise KeyError(f"grammar {grammar_id} is not compiled on rank {self.rank}")
        return RequestGrammar(xgr.GrammarMatcher(compiled), grammar_id)

    def accept(self, grammars: list[RequestGrammar], tokens: list[int]) -> dict[int, str]:
        """Advance each matcher by its token (one call into xgrammar for all). Returns {index in `grammars`:
        error} for the tokens refused; a matcher already complete ignores its token (the end tokens that
        follow it when the request ignores EOS), and one that refused a token before ignores every later one."""
        import xgrammar as xgr

        todo = [i for i, g in enumerate(grammars) if g.error is None and not g.matcher.is_terminated()]
        if not todo:
            return {}
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([grammars[i].matcher for i in todo],
                                                              [tokens[i] for i in todo])
        errors = {}
        for i, ok in zip(todo, accepted):
            if not ok:
                g = grammars[i]
                g.error = (f"structured_outputs: the token sampled ({tokens[i]}) is outside the grammar: another "
                           "parameter (bad_words, min_tokens) banned every token the grammar allowed there")
                errors[i] = g.error
        return errors

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> torch.Tensor:
        """The next-token bitmask of each of `grammars`: `[G, width]` int32 on the host (pinned on CUDA), in a
        buffer reused by the next call. A complete grammar allows only the end tokens; a matcher that refused
        a token allows every token (its request is failing)."""
        import xgrammar as xgr

        width = bitmask_width(self.vocab_size)
        n = len(grammars)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            size = max(n, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = torch.empty((size, width), dtype=torch.int32, pin_memory=self.pin_memory)
            self._batch = xgr.BatchGrammarMatcher(self.threads)
        bitmask = self._bitmask[:n]
        live: list[int] = []
        for i, g in enumerate(grammars):
            if g.error is not None:
                bitmask[i] = -1
            elif g.matcher.is_terminated():
                bitmask[i] = torch.from_numpy(self._end_tokens_mask())
            else:
                live.append(i)
        if live:
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in live], bitmask, live)
        return bitmask

    def _end_tokens_mask(self) -> np.ndarray:
        if self._end_mask is None:
            mask = np.zeros(bitmask_width(self.vocab_size) * 32, dtype=np.uint8)
            mask[self.end_token_ids] = 1
            self._end_mask = np.packbits(mask, bitorder="little").view(np.int32)
        return self._end_mask


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
