"""Profiling sessions (common/profiling.py). The scheduler numbers the steps, so it decides when a session
starts and stops::

    client --StartProfile/StopProfile--> frontend --(same)--> scheduler --ProfileStart/ProfileStop--> workers, frontend

The scheduler answers each request with a `ProfileStatus`, which the frontend passes on."""

from __future__ import annotations

from common.protocol.codec import wire_message


@wire_message
class StartProfile:
    """Client -> frontend -> scheduler: trace every process from the next step on, for at most `num_steps`
    steps (0: as many as the engine's `--profile-steps` window holds)."""

    num_steps: int = 0


@wire_message
class StopProfile:
    """Client -> frontend -> scheduler: end the trace after the last step planned so far."""


@wire_message
class ProfileStart:
    """Scheduler -> every worker rank and the frontend: start tracing now; `first_step` is the next step
    to run. The trace ends after `last_step`, or at the `ProfileStop` that says an earlier step."""

    session: int  # 1, 2, ... in this engine's life
    first_step: int  # step ids, both traced
    last_step: int
    folder: str  # where every process writes its files for this session


@wire_message
class ProfileStop:
    """Scheduler -> workers (right after the plan of `last_step`) and frontend (after that step's
    outputs): stop tracing once step `last_step` is done and write the files."""

    session: int  # ProfileStart's
    last_step: int  # first_step - 1 when the session ended before any step ran


@wire_message
class ProfileStatus:
    """Scheduler -> frontend -> client: the answer to one `StartProfile` or `StopProfile`. A stop is
    answered once the session's timeline is merged, with its summary."""

    session: int = 0  # 0: none (the request was refused: see `error`)
    first_step: int = -1  # the session's traced steps, as in ProfileStart; -1: none
    last_step: int = -1
    folder: str = ""  # where the session's files are
    summary: str = ""  # the summary table of a stopped session (also in <folder>/summary.txt)
    error: str | None = None  # why the request was refused; nothing changed
