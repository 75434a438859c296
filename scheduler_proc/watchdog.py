"""The step watchdog: how long a step may stay unfinished before the workers count as stuck.

A worker that stops making progress without exiting (SIGSTOP, a hung device, a peer lost inside a
collective) would leave every request waiting forever, and a fixed timeout long enough for the
slowest legitimate step (a CPU prefill chunk of 8k tokens took 203 s) would take an hour to notice a
stopped CPU worker. So the bound is relative to what this engine has measured:

- A step's *shape* is the pair (power-of-two bucket of its scheduled tokens, power-of-two bucket of
  the context tokens its rows attend to, their sum over rows). A step's time grows with both, and
  within one bucket of each they vary by at most 2x, so steps of one shape take about as long.
- A step of a shape seen before may take `factor` (20) times the longest step of that shape so far,
  and at least `floor_s` (DELTASERVE_STEP_TIMEOUT_FLOOR_S, 60 s).
- A step of an unseen shape takes the smallest bound that any comparable seen shape gives it: a seen shape at
  least as large in both buckets did more work, so its bound holds; a seen shape it covers did less, and a
  step's work grows at most with its tokens times the context its rows attend to (linear layers with the
  tokens, attention with both), so a shape `dt` token buckets and `dc` context buckets above it may take
  `2 ** (dt + dc)` times as long (`factor` times that). So a step larger than any so far (a new prompt
  arriving among running decodes) is bounded by minutes, not by the generous `unseen_s`, and a decode step
  after a long prefill by the decodes before it, not by 20 times that prefill.
- With nothing measured at all (the first step), the bound is `unseen_s` (DELTASERVE_STEP_TIMEOUT_S: 300 s
  on GPUs, 3600 s on CPU), which also caps every bound.

A step is timed from when the workers could start it: when its plan was sent, or when the step
before it finished, whichever is later (steps are pipelined: a plan waits behind the one in flight).

A profiling session's end is excused (`excuse_after`): each worker writes its trace once the session's last step
is done, before it finishes the next one, and on CPU that takes minutes (a 256-row session of 100 steps wrote
1.5 GB of events in over 60 s). The first step after the session is bounded only by `unseen_s`, and its time is
not learned as its shape's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from common.protocol import StepPlan

STEP_TIMEOUT_FACTOR = 20.0


@dataclass(frozen=True, order=True)
class StepShape:
    """Power-of-two buckets (`int.bit_length`) of a step's scheduled tokens and attended context tokens."""

    tokens_bucket: int
    context_bucket: int

    @classmethod
    def of(cls, plan: StepPlan, context_len: Callable[[int], int]) -> StepShape:
        """The shape of `plan`; `context_len(seq_id)` is a request's context after the step (its computed
        tokens, this step's included)."""
        tokens = (sum(r.num_scheduled_tokens for r in plan.new_requests)
                  + sum(r.num_scheduled_tokens for r in plan.resumed_requests)
                  + int(plan.prefill_num_tokens.sum()) + len(plan.decode_seq_ids))
        context = (sum(r.num_computed_tokens + r.num_scheduled_tokens for r in plan.new_requests)
                   + sum(r.num_computed_tokens + r.num_scheduled_tokens for r in plan.resumed_requests)
                   + sum(context_len(i) for i in plan.prefill_seq_ids.tolist())
                   + sum(context_len(i) for i in plan.decode_seq_ids.tolist()))
        return cls(int(tokens).bit_length(), int(context).bit_length())

    def covers(self, other: StepShape) -> bool:
        """Whether a step of this shape does at least the work of one of `other`."""
        return self.tokens_bucket >= other.tokens_bucket and self.context_bucket >= other.context_bucket


@dataclass
class _InFlight:
    shape: StepShape
    sent: float  # time.monotonic() when its plan went out


@dataclass(frozen=True)
class StuckStep:
    """A step over its bound: what the error message tells."""

    step_id: int
    waited_s: float
    bound_s: float
    longest_s: float | None  # the longest step of its shape (or of the shape that bounds it); None: none seen
    work_ratio: float = 1.0  # > 1: bounded by a smaller shape's longest step times this (extrapolated)
    after_profiling: bool = False  # the first step after a profiling session (`StepWatchdog.excuse_after`)


class StepWatchdog:
    """Times the steps in flight against bounds learned from finished ones (the module docstring).

    `unseen_s` 0 turns the watchdog off. Times are `time.monotonic()` seconds, passed in by the caller.
    """

    def __init__(self, unseen_s: float, floor_s: float, factor: float = STEP_TIMEOUT_FACTOR) -> None:
        self.unseen_s = unseen_s
        self.floor_s = floor_s
        self.factor = factor
        self.longest: dict[StepShape, float] = {}  # shape -> longest step time seen (seconds)
        self.in_flight: OrderedDict[int, _InFlight] = OrderedDict()  # step id -> its shape and send time, in order
        self.last_finished = 0.0
        self.excused_after: int | None = None  # the first step above this id may include a trace write

    def excuse_after(self, step_id: int) -> None:
        """The workers write a profiler trace once step `step_id` is done: the first later step to finish may
        take up to `unseen_s`, and its time says nothing of its shape."""
        self.excused_after = step_id

    def _excused(self, step_id: int) -> bool:
        return self.excused_after is not None and step_id > self.excused_after

    def sent(self, step_id: int, shape: StepShape, now: float) -> None:
        self.in_flight[step_id] = _InFlight(shape, now)

    def finished(self, step_id: int, now: float) -> None:
        step = self.in_flight.pop(step_id, None)
        if step is None:
            return
        took = now - max(step.sent, self.last_finished)
        self.last_finished = now
        if self._excused(step_id):
            self.excused_after = None
            return
        if took > self.longest.get(step.shape, -1.0):
            self.longest[step.shape] = took

    def bound_s(self, shape: StepShape) -> tuple[float, float | None]:
        """(seconds a step of `shape` may take, the longest step time that set it (of `shape` itself, of the
        larger shape that bounds it, or of the smaller one it is extrapolated from) or None)."""
        bound, longest, _ = self._bound(shape)
        return bound, longest

    def _bound(self, shape: StepShape) -> tuple[float, float | None, float]:
        """`bound_s` and the work ratio it was extrapolated by (1.0 where it was not)."""
        longest = self.longest.get(shape)
        if longest is not None:
            return self._relative(longest), longest, 1.0
        bounds = []
        for seen, t in self.longest.items():
            if seen.covers(shape):  # a larger shape: its steps did more work
                ratio = 1.0
            elif shape.covers(seen):  # a smaller one: at most 2x the work per bucket above it
                ratio = 2.0 ** (shape.tokens_bucket - seen.tokens_bucket + shape.context_bucket - seen.context_bucket)
            else:
                continue
            bounds.append((self._relative(t * ratio), t, ratio))
        return min(bounds) if bounds else (self.unseen_s, None, 1.0)

    def _relative(self, longest_s: float) -> float:
        return min(self.unseen_s, max(self.floor_s, self.factor * longest_s))

    def stuck(self, now: float) -> StuckStep | None:
        """The oldest step in flight if it has run past its bound, else None."""
        if not self.in_flight or not self.unseen_s:
            return None
        step_id, step = next(iter(self.in_flight.items()))  # plans are sent in order: the first is the oldest
        waited = now - max(step.sent, self.last_finished)
        excused = self._excused(step_id)
        bound, longest, ratio = (self.unseen_s, None, 1.0) if excused else self._bound(step.shape)
        if waited <= bound:
            return None
        return StuckStep(step_id, waited, bound, longest, ratio, excused)
