"""The limits every prompt must meet, checked in one place (by the frontend, and again by the scheduler)."""

from __future__ import annotations

import numpy as np

from common.units import count


def token_id_range_error(min_id: int, max_id: int, vocab_size: int) -> str | None:
    """Why prompt token ids from `min_id` to `max_id` (any Python ints, also past 64 bits) are not all in the
    vocabulary [0, vocab_size), or None if they are (or `vocab_size` is 0: unknown)."""
    if vocab_size and (min_id < 0 or max_id >= vocab_size):
        return f"prompt token ids must be in [0, {vocab_size}); got min {min_id}, max {max_id}"
    return None


def prompt_limit_error(token_ids: np.ndarray, max_model_len: int, block_size: int, num_kv_blocks: int,
                       vocab_size: int) -> str | None:
    """Why a prompt of these token ids can never run, naming the limit; None if it can.

    `token_ids`: `[n]` integer array. Lengths are in tokens; `vocab_size` 0 skips the id range check.
    """
    n = len(token_ids)
    if n == 0:
        return "the prompt is empty: at least one prompt token is needed"
    range_error = token_id_range_error(int(token_ids.min()), int(token_ids.max()), vocab_size)
    if range_error is not None:
        return range_error
    if n >= max_model_len:
        return (f"the prompt has {count(n, 'token')} but max_model_len is {max_model_len}: "
                "a prompt must be shorter than max_model_len to leave room for output")
    blocks = -(-n // block_size)
    if blocks > num_kv_blocks:
        return (f"the prompt has {count(n, 'token')} and needs {count(blocks, 'KV-cache block')} of "
                f"{count(block_size, 'token')}, but the whole cache has only {count(num_kv_blocks, 'block')}")
    return None
