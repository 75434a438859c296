"""The scheduler's book of structured-output grammars: which the workers hold compiled, which are compiling,
and which requests wait for them.

The workers own the matchers (workers/structured_output.py) and compile each grammar off their step loop;
the scheduler only numbers the distinct constraints, tells every rank to compile a new one
(`CompileGrammars`), and admits a request only once every rank has answered `GrammarCompiled` without an
error. A request never holds up another: until its grammar is ready it stays out of the waiting queue.

Cache: a grammar stays compiled on the workers while a live request uses it, and afterwards among the
`max_idle` most recently used idle ones; the oldest idle grammar beyond that is forgotten (its id goes to
the workers in the next `CompileGrammars`) and compiled again if a request names it later. A grammar that
failed to compile is remembered the same way, so the same bad schema fails at once, without compiling.
Ids are never reused, so a late message can never name another grammar.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.protocol import CompileGrammars, GrammarSpec, GrammarToCompile, i32

if TYPE_CHECKING:
    from scheduler_proc.sequence import Sequence

MAX_IDLE_GRAMMARS = 64  # compiled grammars kept for reuse once no request uses them (xgrammar: ~1-4 MB each)


@dataclass
class GrammarEntry:
    grammar_id: int
    spec: GrammarSpec
    users: int = 0  # live sequences (waiting, running or preempted) that use it
    ranks_done: set[int] = field(default_factory=set)
    ready: bool = False  # every rank compiled it
    error: str | None = None  # a rank could not compile it: why
    waiting: list[Sequence] = field(default_factory=list)  # requests admitted once it is ready, in arrival order

    @property
    def compiling(self) -> bool:
        return not self.ready and self.error is None


class GrammarCache:
    def __init__(self, num_ranks: int, max_idle: int = MAX_IDLE_GRAMMARS) -> None:
        self.num_ranks = num_ranks
        self.max_idle = max_idle
        self.by_spec: dict[tuple[str, str, bool], GrammarEntry] = {}
        self.entries: dict[int, GrammarEntry] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # entries without users, least recently used first
        self.next_id = 0
        self._to_compile: list[GrammarToCompile] = []
        self._to_forget: list[int] = []

    def acquire(self, spec: GrammarSpec) -> GrammarEntry:
        """The entry of `spec`, with one more user; a new one is queued for compilation (`take_work`)."""
        key = (spec.kind, spec.spec, spec.any_whitespace)
        entry = self.by_spec.get(key)
        if entry is None:
            entry = GrammarEntry(self.next_id, spec)
            self.next_id += 1
            self.by_spec[key] = entry
            self.entries[entry.grammar_id] = entry
            self._to_compile.append(GrammarToCompile(entry.grammar_id, spec))
        entry.users += 1
        self.idle.pop(entry.grammar_id, None)
        return entry

    def release(self, grammar_id: int) -> None:
        """One user fewer; an entry left without users becomes idle, and the oldest idle ones beyond
        `max_idle` are forgotten. Compiling entries are kept until every rank has answered."""
        entry = self.entries[grammar_id]
        entry.users -= 1
        assert entry.users >= 0, entry
        if entry.users == 0:
            self.idle[grammar_id] = None
            self._evict()

    def compiled(self, rank: int, grammar_id: int, error: str | None) -> GrammarEntry | None:
        """Record one rank's answer; return the entry once it is settled by this answer (every rank compiled
        it, or the first error), else None. Answers for a settled or forgotten entry are ignored."""
        entry = self.entries.get(grammar_id)
        if entry is None or not entry.compiling:
            return None
        if error is not None:
            entry.error = error
        else:
            entry.ranks_done.add(rank)
            if len(entry.ranks_done) < self.num_ranks:
                return None
            entry.ready = True
        if entry.users == 0:
            self._evict()
        return entry

    def take_work(self) -> CompileGrammars | None:
        """What the workers must compile and may forget since the last call, or None."""
        if not self._to_compile and not self._to_forget:
            return None
        msg = CompileGrammars(self._to_compile, i32(self._to_forget))
        self._to_compile, self._to_forget = [], []
        return msg

    def _evict(self) -> None:
        settled = [gid for gid in self.idle if not self.entries[gid].compiling]
        for gid in settled[: max(0, len(settled) - self.max_idle)]:
            entry = self.entries.pop(gid)
            del self.idle[gid]
            del self.by_spec[(entry.spec.kind, entry.spec.spec, entry.spec.any_whitespace)]
            self._to_forget.append(gid)  # also a failed one: another rank may have compiled it
