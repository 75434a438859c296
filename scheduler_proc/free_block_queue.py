"""The block manager's free queue: free KV-block ids in the order they were freed, with O(1) take and removal.

A block is taken from the front (the least recently freed, so cached prefixes that were freed long ago are the
first to lose their content) and returned to the back; a cached block that a new sequence revives leaves the queue
from wherever it stands. An insertion-ordered dict did all three, but taking its first key skips every key deleted
from its front since the dict last compacted: 44 us a take at 131,072 blocks, most of the scheduler's CPU in a
burst (benchmarks/soak.py), and a step in its memory when the dict finally resized.

Here the queue is a deque of (generation, block id) entries and a dict from each free block id to the generation of
its live entry. Removing a block deletes its dict key only; its entry goes stale and is dropped when it reaches the
front (or when stale entries outnumber live ones, by one rebuild), so every operation is O(1) amortized and the
deque never holds more than about twice the free blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

_COMPACT_SLACK = 1024  # stale entries tolerated beyond the live ones before a rebuild


class FreeBlockQueue:
    """Free block ids, least recently freed first. The dict-like spelling of the old insertion-ordered set is kept:
    `queue[block_id] = None` returns a block to the back, `del queue[block_id]` removes it from anywhere, iteration
    yields the ids front to back, `len` counts them. Raises KeyError for a removal of an id that is not free, and
    ValueError for a return of one that already is."""

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._entries: deque[tuple[int, int]] = deque()
        self._generation: dict[int, int] = {}
        self._next_generation = 0
        for block_id in block_ids:
            self[block_id] = None

    def __len__(self) -> int:
        return len(self._generation)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._generation

    def __iter__(self) -> Iterator[int]:
        generation = self._generation
        return (b for g, b in list(self._entries) if generation.get(b) == g)

    def __setitem__(self, block_id: int, _: None) -> None:
        if block_id in self._generation:
            raise ValueError(f"block {block_id} is already free")
        g = self._next_generation
        self._next_generation = g + 1
        self._generation[block_id] = g
        self._entries.append((g, block_id))
        if len(self._entries) > 2 * len(self._generation) + _COMPACT_SLACK:
            self._entries = deque(e for e in self._entries if self._generation.get(e[1]) == e[0])

    def __delitem__(self, block_id: int) -> None:
        del self._generation[block_id]  # its entry is stale from now on

    def popleft(self) -> int:
        """Take the least recently freed block id. Raises IndexError when none is free."""
        entries, generation = self._entries, self._generation
        while entries:
            g, block_id = entries.popleft()
            if generation.get(block_id) == g:
                del generation[block_id]
                return block_id
        raise IndexError("no free block")
