"""Errors whose message is the whole story: logged without a traceback."""

from __future__ import annotations


class ExplainedError(RuntimeError):
    """A failure the engine anticipates (a missing device, a stuck step, a silent peer), whose message
    says all a user needs: what went wrong and, where there is one, what to change. A process ending by
    one logs and reports that message alone; any other exception is logged with its traceback.
    `ConfigError` (an unusable model or setting) is taken the same way."""
