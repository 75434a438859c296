"""The free-block queue: least recently freed first, removal from anywhere, bounded storage."""

from __future__ import annotations

import random
import sys

import pytest

from scheduler_proc.free_block_queue import FreeBlockQueue


def test_blocks_leave_in_the_order_they_were_freed() -> None:
    q = FreeBlockQueue(4)
    taken = [q.popleft(), q.popleft()]
    q[taken[1]] = None
    q[taken[0]] = None

    assert taken == [0, 1]
    assert list(q) == [2, 3, 1, 0]
    assert len(q) == 4


def test_a_revived_block_leaves_from_the_middle_and_returns_at_the_back() -> None:
    q = FreeBlockQueue(5)
    del q[2]
    assert 2 not in q and list(q) == [0, 1, 3, 4]
    q[2] = None

    assert [q.popleft() for _ in range(5)] == [0, 1, 3, 4, 2]
    with pytest.raises(IndexError):
        q.popleft()


def test_wrong_returns_and_removals_are_refused() -> None:
    q = FreeBlockQueue(2)
    with pytest.raises(ValueError, match="already free"):
        q[1] = None
    del q[1]
    with pytest.raises(KeyError):
        del q[1]


def test_matches_an_insertion_ordered_dict_under_random_use() -> None:
    rng = random.Random(0)
    q, ref = FreeBlockQueue(64), dict.fromkeys(range(64))
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


def test_storage_never_grows_whatever_the_use() -> None:
    """The soak's third burst once doubled the old queue's dict (a 5.6 MiB step in the scheduler): the storage is
    allocated for every block at the start and is the same size after rounds of takes, revivals and returns."""
    q = FreeBlockQueue(4096)
    sizes = (sys.getsizeof(q._next), sys.getsizeof(q._prev), sys.getsizeof(q._free))
    for _ in range(10):  # rounds like the soak's bursts: take most blocks, revive some, return them all
        taken = [q.popleft() for _ in range(3000)]
        for block in list(q)[::7]:
            del q[block]
            taken.append(block)
        for block in taken:
            q[block] = None
    for _ in range(50_000):  # a prefix-cache hit every time: free -> revive -> free, never a take
        del q[7]
        q[7] = None

    assert (sys.getsizeof(q._next), sys.getsizeof(q._prev), sys.getsizeof(q._free)) == sizes
    assert list(q)[-1] == 7 and len(q) == 4096 and sorted(q) == list(range(4096))


def test_ids_outside_the_pool_are_refused_and_an_empty_pool_works() -> None:
    q = FreeBlockQueue(3)
    with pytest.raises(IndexError, match="outside"):
        q[3] = None
    with pytest.raises(IndexError, match="outside"):
        del q[-1]
    assert 3 not in q and "x" not in q
    empty = FreeBlockQueue(0)
    assert len(empty) == 0 and list(empty) == []
    with pytest.raises(IndexError):
        empty.popleft()
