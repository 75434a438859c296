"""Pausing CPython's cyclic garbage collector while a client builds many small objects.

Building an output's logprobs makes an object (or a dict) per position and per top entry: 800,000 of them for
`benchmarks/throughput.py --filtered` (134,000 positions, 5 top logprobs each). Every 700 new container objects
start a collection of the youngest generation, and every few of those one of the older ones, so the collector
scanned the same live objects over and over: building those objects took 0.87 s on the CI machine with it on and
0.19 s with it off. The objects built here form no reference cycles, so reference counting frees them whatever
the collector does, and pausing it loses nothing."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees what is dropped); afterwards the
    collector is on again if it was on before. Another thread's garbage cycles wait for the next collection."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
