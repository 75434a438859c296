"""The block manager's free queue: free KV-block ids in the order they were freed, with O(1) take and removal.

A block is taken from the front (the least recently freed, so cached prefixes that were freed long ago are the
first to lose their content) and returned to the back; a cached block that a new sequence revives leaves the queue
from wherever it stands (vLLM's `FreeKVCacheBlockQueue` keeps the same order with linked block objects).

Block ids are 0 .. num_blocks - 1, so the queue is a circular doubly linked list in two fixed int64 arrays indexed by
block id (`_next`, `_prev`), with one sentinel slot (id `num_blocks`) that is both the front's predecessor and the
back's successor. Its storage is allocated once and never grows. Two earlier forms did grow: an insertion-ordered
dict (taking its first key skipped every key deleted from its front since the dict last compacted: 44 us a take at
131,072 blocks), then a deque of (generation, id) entries beside a dict of live generations, whose dict doubled to
10 MiB in the third burst of benchmarks/soak.py when its deleted slots ran out: a 5.6 MiB step in the scheduler's
memory that never came back.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator


class FreeBlockQueue:
    """The free ones among block ids 0 .. `num_blocks` - 1, least recently freed first; all are free at the start,
    in id order. The dict-like spelling of the old insertion-ordered set is kept: `queue[block_id] = None` returns
    a block to the back, `del queue[block_id]` removes it from anywhere, iteration yields the ids front to back,
    `len` counts them. Raises KeyError for a removal of an id that is not free, ValueError for a return of one that
    already is, IndexError for an id outside 0 .. num_blocks - 1."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._sentinel = s = num_blocks
        # Machine integers, 16 bytes a block in all: lists held an int object per link (10 MiB at 131,072 blocks),
        # and tests/test_soak.py's scheduler grew about 100 KiB more over its bursts with them.
        self._next = array("q", range(1, num_blocks + 1))
        self._next.append(0 if num_blocks else s)  # the sentinel's next is the front
        self._prev = array("q", [s])  # the sentinel's prev is the back
        self._prev.extend(range(num_blocks))
        self._free = bytearray(b"\x01") * num_blocks
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, int) and 0 <= block_id < self._sentinel and bool(self._free[block_id])

    def __iter__(self) -> Iterator[int]:
        ids, nxt, s = [], self._next, self._sentinel
        b = nxt[s]
        while b != s:
            ids.append(b)
            b = nxt[b]
        return iter(ids)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self._sentinel:
            raise IndexError(f"block id {block_id} is outside 0 .. {self._sentinel - 1}")

    def __setitem__(self, block_id: int, _: None) -> None:
        self._check(block_id)
        if self._free[block_id]:
            raise ValueError(f"block {block_id} is already free")
        s, prev = self._sentinel, self._prev
        back = prev[s]
        self._next[back] = block_id
        prev[block_id] = back
        self._next[block_id] = s
        prev[s] = block_id
        self._free[block_id] = 1
        self._len += 1

    def __delitem__(self, block_id: int) -> None:
        self._check(block_id)
        if not self._free[block_id]:
            raise KeyError(block_id)
        nxt, prev = self._next, self._prev
        before, after = prev[block_id], nxt[block_id]
        nxt[before] = after
        prev[after] = before
        self._free[block_id] = 0
        self._len -= 1

    def popleft(self) -> int:
        """Take the least recently freed block id. Raises IndexError when none is free."""
        front = self._next[self._sentinel]
        if front == self._sentinel:
            raise IndexError("no free block")
        del self[front]
        return front
