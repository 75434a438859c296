"""The free-block queue: least recently freed first, removal from anywhere, bounded storage."""

from __future__ import annotations

import random

import pytest

from scheduler_proc.free_block_queue import FreeBlockQueue


def test_blocks_leave_in_the_order_they_were_freed() -> None:
    q = FreeBlockQueue(range(4))
    taken = [q.popleft(), q.popleft()]
    q[taken[1]] = None
    q[taken[0]] = None

    assert taken == [0, 1]
    assert list(q) == [2, 3, 1, 0]
    assert len(q) == 4


def test_a_revived_block_leaves_from_the_middle_and_returns_at_the_back() -> None:
    q = FreeBlockQueue(range(5))
    del q[2]
    assert 2 not in q and list(q) == [0, 1, 3, 4]
    q[2] = None

    assert [q.popleft() for _ in range(5)] == [0, 1, 3, 4, 2]
    with pytest.raises(IndexError):
        q.popleft()


def test_wrong_returns_and_removals_are_refused() -> None:
    q = FreeBlockQueue(range(2))
    with pytest.raises(ValueError, match="already free"):
        q[1] = None
    del q[1]
    with pytest.raises(KeyError):
        del q[1]


def test_matches_an_insertion_ordered_dict_under_random_use() -> None:
    rng = random.Random(0)
    q, ref = FreeBlockQueue(range(64)), dict.fromkeys(range(64))
    used: list[int] = []
    for _ in range(20_000):
        op = rng.random()
        if op < 0.4 and ref:
            block = next(iter(ref))
            del ref[block]
            assert q.popleft() == block
            used.append(block)
        elif op < 0.6 and ref:
            block = rng.choice(list(ref))
            del ref[block], q[block]
            used.append(block)
        elif used:
            block = used.pop(rng.randrange(len(used)))
            ref[block] = None
            q[block] = None
        assert len(q) == len(ref)
    assert list(q) == list(ref)


def test_storage_stays_bounded_when_the_same_blocks_are_revived_and_freed_for_ever() -> None:
    q = FreeBlockQueue(range(100))
    for _ in range(50_000):  # a prefix-cache hit every time: free -> revive -> free, never a take
        del q[7]
        q[7] = None

    assert len(q._entries) <= 2 * len(q) + 1024 + 1
    assert list(q)[-1] == 7 and len(q) == 100
