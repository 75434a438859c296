"""Counts and sizes as messages write them: "1 block" but "2 blocks", and bytes in a unit that shows them."""

from __future__ import annotations

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, in the plural unless `n` is 1: "1 block", "0 blocks", "3 blocks" (`plural` when it is
    not `noun` + "s")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def format_bytes(num_bytes: float) -> str:
    """A size in the largest binary unit that keeps it at least 1, to about 3 significant digits:
    "512 B", "288 KiB", "1.5 GiB", "97.7 TiB" (1 KiB = 1024 B)."""
    value, unit = float(num_bytes), 0
    while abs(value) >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{round(value, digits):g} {_BINARY_UNITS[unit]}"
