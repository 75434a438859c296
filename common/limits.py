"""The limits every prompt must meet, checked in one place (by the frontend, and again by the scheduler)."""

from __future__ import annotations

import numpy as np


def prompt_limit_error(token_ids: np.ndarray, max_model_len: int, block_size: int, num_kv_blocks: int,
                       vocab_size: int) -> str | None:
    """Why a prompt of these token ids can never run, naming the limit; None if it can.

    `token_ids`: `[n]` integer array. Lengths are in tokens; `vocab_size` 0 skips the id range check.
    """
    n = len(token_ids)
    if n == 0:
        return "the prompt is empty: at least one prompt token is needed"
    if vocab_size and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        return (f"prompt token ids must be in [0, {vocab_size}); "
                f"got min {int(token_ids.min())}, max {int(token_ids.max())}")
    if n >= max_model_len:
        return (f"the prompt has {n} tokens but max_model_len is {max_model_len}: "
                "a prompt must be shorter than max_model_len to leave room for output")
    blocks = -(-n // block_size)
    if blocks > num_kv_blocks:
        return (f"the prompt has {n} tokens and needs {blocks} KV-cache blocks of {block_size} tokens, "
                f"but the whole cache has only {num_kv_blocks} blocks")
    return None
