"""BlockManager: chained block hashes verified against stored tokens, reference counts, LRU reuse,
lazy eviction of hash entries, and the accounting invariants (scenarios.md, BAI 1-3)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import scheduler_proc.block_manager as block_manager_module
from scheduler_proc.block_manager import NO_HASH, BlockManager, hash_block, token_bytes
from scheduler_proc.sequence import Sequence
from tests.fake_worker import make_request

BS = 4


def seq_of(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(make_request(seq_id, tokens, max_tokens=8))


def admit(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> list[int]:
    """Allocate `seq` the way the scheduler admits it, mark its KV computed, register its full blocks.

    Returns the cached prefix it was given.
    """
    n = len(seq.token_ids) if num_tokens is None else num_tokens
    cached = bm.find_cached_prefix(seq)
    assert bm.can_allocate(cached, n)
    bm.allocate(seq, cached, n)
    seq.num_computed_tokens = n
    bm.cache_full_blocks(seq)
    return cached


# ============================================================================ hashing
def test_block_hash_chains_over_the_parent_hash() -> None:
    first = hash_block([1, 2, 3, 4], NO_HASH)
    assert hash_block([1, 2, 3, 4], NO_HASH) == first
    assert hash_block([5, 6, 7, 8], first) != hash_block([5, 6, 7, 8], hash_block([9, 2, 3, 4], NO_HASH))
    assert hash_block([1, 2, 3, 4], NO_HASH) != hash_block([1, 2, 3, 5], NO_HASH)
    assert 0 <= first < 2**63  # a non-negative int64 on the wire


def test_compute_block_hashes_covers_full_blocks_only_and_chains_them() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks
    hashes = bm.compute_block_hashes(seq_of(tokens))
    h0 = hash_block(tokens[0:4], NO_HASH)
    assert hashes == [h0, hash_block(tokens[4:8], h0)]


def test_same_block_tokens_after_a_different_prefix_is_not_a_hit() -> None:
    bm = BlockManager(8, BS)
    admit(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=0))
    other = seq_of([0, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=1)  # block 1 equal, block 0 not
    assert bm.find_cached_prefix(other) == []


def test_forced_hash_collision_never_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block", lambda token_ids, parent_hash: 42)
    bm = BlockManager(8, BS)
    a = seq_of([1, 2, 3, 4, 5], seq_id=0)
    admit(bm, a)
    assert bm.hash_to_block_id == {42: a.block_table[0]}
    b = seq_of([9, 9, 9, 9, 5], seq_id=1)  # same (forced) hash, other tokens
    assert bm.find_cached_prefix(b) == []
    c = seq_of([1, 2, 3, 4, 7], seq_id=2)  # the same tokens still hit
    assert bm.find_cached_prefix(c) == [a.block_table[0]]


def test_a_colliding_block_is_left_unregistered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block", lambda token_ids, parent_hash: 42)
    bm = BlockManager(8, BS)
    a = seq_of([1, 2, 3, 4, 5], seq_id=0)
    admit(bm, a)
    b = seq_of([9, 9, 9, 9, 5], seq_id=1)
    admit(bm, b)
    assert bm.hash_to_block_id == {42: a.block_table[0]}
    assert bm.blocks[b.block_table[0]].hash == NO_HASH
    bm.check_invariants([a, b])


# ============================================================================ sharing and ref counts
def test_shared_prefix_blocks_are_reference_counted() -> None:
    bm = BlockManager(10, BS)
    prefix = [7, 7, 7, 7, 8, 8, 8, 8]
    a = seq_of(prefix + [1, 2], seq_id=0)
    b = seq_of(prefix + [3], seq_id=1)
    admit(bm, a)
    assert admit(bm, b) == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 10 - 4
    bm.check_invariants([a, b])

    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 10 - 3
    bm.check_invariants([b])
    bm.free(b)
    assert bm.num_free_blocks == 10
    bm.check_invariants([])


def test_duplicate_prompt_shares_blocks_it_hits_and_owns_the_rest() -> None:
    bm = BlockManager(10, BS)
    tokens = list(range(100, 112))  # 3 full blocks
    a, b = seq_of(tokens, 0), seq_of(tokens, 1)
    admit(bm, a)
    cached = admit(bm, b)
    assert cached == a.block_table[:2]  # the last token's block is computed again (BR-01)
    assert b.block_table[2] != a.block_table[2]
    assert len(bm.hash_to_block_id) == 3 and set(bm.hash_to_block_id.values()) == set(a.block_table)


# ============================================================================ LRU and lazy eviction
def test_free_blocks_are_reused_least_recently_freed_first_tail_before_prefix() -> None:
    bm = BlockManager(6, BS)
    a = seq_of(list(range(8)), 0)  # blocks 0, 1
    b = seq_of(list(range(50, 58)), 1)  # blocks 2, 3
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(b)
    bm.free(a)
    # Never used 4, 5 first; then b's tail, b's head, a's tail, a's head.
    assert list(bm.free_block_ids) == [4, 5, 3, 2, 1, 0]
    c = seq_of(list(range(200, 224)), 2)
    admit(bm, c)
    assert c.block_table == [4, 5, 3, 2, 1, 0]


def test_freed_block_keeps_its_hash_until_reused_then_the_stale_entry_goes() -> None:
    bm = BlockManager(2, BS)
    a = seq_of([1, 2, 3, 4, 5], 0)
    admit(bm, a)
    block = a.block_table[0]
    h = bm.blocks[block].hash
    bm.free(a)
    assert bm.hash_to_block_id == {h: block} and bm.blocks[block].token_ids == token_bytes([1, 2, 3, 4])
    assert bm.find_cached_prefix(seq_of([1, 2, 3, 4, 9], 1)) == [block]  # still a hit while free

    other = seq_of([8, 8, 8, 8, 8, 8, 8, 8], 2)  # takes both blocks, overwriting a's
    admit(bm, other, num_tokens=8)
    assert block in other.block_table
    assert h not in bm.hash_to_block_id
    assert bm.find_cached_prefix(seq_of([1, 2, 3, 4, 9], 3)) == []
    bm.check_invariants([other])


def test_reusing_an_unregistered_twin_block_keeps_the_entry_of_the_registered_one() -> None:
    bm = BlockManager(4, BS)
    a = seq_of([1, 2, 3, 4, 5], 0)
    admit(bm, a)
    registered = a.block_table[0]
    h = bm.blocks[registered].hash
    b = seq_of([1, 2, 3, 4], 1)
    admit(bm, b)  # no hit (its only block holds its last token): it computes a twin block
    twin = b.block_table[0]
    assert twin != registered and bm.blocks[twin].hash == NO_HASH
    bm.free(b)
    bm.free(a)
    assert list(bm.free_block_ids)[:2] == [3, twin]
    taker = seq_of([9] * 8, 2)
    admit(bm, taker, num_tokens=8)  # takes the never-used block and the twin
    assert taker.block_table == [3, twin]
    assert bm.hash_to_block_id[h] == registered
    bm.check_invariants([taker])


# ============================================================================ the last token's block
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 8, 9, 12, 13])
def test_cached_prefix_never_includes_the_last_tokens_block(num_tokens: int) -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(1, num_tokens + 1))
    admit(bm, seq_of(tokens, 0))
    hit = bm.find_cached_prefix(seq_of(tokens, 1))
    assert len(hit) == (num_tokens - 1) // BS


def test_prefix_caching_disabled_never_hits_or_registers() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    admit(bm, seq_of(tokens, 0))
    assert bm.hash_to_block_id == {}
    assert bm.find_cached_prefix(seq_of(tokens, 1)) == []


# ============================================================================ can_allocate
def test_can_allocate_counts_cached_blocks_sitting_in_the_free_queue() -> None:
    bm = BlockManager(3, BS)
    a = seq_of(list(range(9)), 0)  # 3 blocks, 2 full ones registered
    admit(bm, a)
    bm.free(a)
    again = seq_of(list(range(9)), 1)
    cached = bm.find_cached_prefix(again)
    assert len(cached) == 2 and bm.num_free_blocks == 3
    # 2 revived from the free queue + 1 new = all 3 free blocks.
    assert bm.can_allocate(cached, 9)
    assert not bm.can_allocate(cached, 13)  # a 4th block does not exist
    bm.allocate(again, cached, 9)
    assert again.block_table[:2] == cached and bm.num_free_blocks == 0
    bm.check_invariants([again])


def test_can_allocate_does_not_count_shared_cached_blocks_again() -> None:
    bm = BlockManager(3, BS)
    a = seq_of(list(range(9)), 0)
    admit(bm, a)  # all 3 blocks used
    b = seq_of(list(range(8)) + [99], 1)
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2]
    assert not bm.can_allocate(cached, 9)  # needs one new block; none is free
    assert bm.can_allocate(cached, 8)  # the two shared blocks cost nothing


# ============================================================================ check_invariants
def corrupt_ref_count(bm: BlockManager, seqs: list[Sequence]) -> None:
    bm.blocks[seqs[0].block_table[0]].ref_count += 1


def corrupt_free_and_used(bm: BlockManager, seqs: list[Sequence]) -> None:
    bm.free_block_ids[seqs[0].block_table[0]] = None


def corrupt_lost_block(bm: BlockManager, seqs: list[Sequence]) -> None:
    del bm.free_block_ids[next(iter(bm.free_block_ids))]


def corrupt_hash_entry(bm: BlockManager, seqs: list[Sequence]) -> None:
    h = next(iter(bm.hash_to_block_id))
    bm.hash_to_block_id[h] = seqs[1].block_table[0]


def corrupt_block_tokens(bm: BlockManager, seqs: list[Sequence]) -> None:
    block = bm.blocks[seqs[0].block_table[0]]
    block.token_ids = token_bytes([0] * BS)


def corrupt_table_holds_free_block(bm: BlockManager, seqs: list[Sequence]) -> None:
    seqs[1].block_table.append(next(iter(bm.free_block_ids)))


@pytest.mark.parametrize("corrupt", [corrupt_ref_count, corrupt_free_and_used, corrupt_lost_block, corrupt_hash_entry,
                                     corrupt_block_tokens, corrupt_table_holds_free_block])
def test_check_invariants_catches_a_corrupted_state(corrupt) -> None:
    bm = BlockManager(8, BS)
    seqs = [seq_of([1, 2, 3, 4, 5], 0), seq_of([6, 7, 8, 9, 10], 1)]
    for s in seqs:
        admit(bm, s)
    bm.check_invariants(seqs)
    corrupt(bm, seqs)
    with pytest.raises(AssertionError):
        bm.check_invariants(seqs)


def test_freeing_a_sequence_twice_is_caught() -> None:
    bm = BlockManager(4, BS)
    a = seq_of([1, 2, 3], 0)
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


# ============================================================================ random operations
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=14)  # a tiny alphabet: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / grow / free / cache on live sequences; every invariant after every operation."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(tokens=TOKENS)
    def admit_a_sequence(self, tokens: list[int]) -> None:
        seq = seq_of(tokens, self.next_id)
        self.next_id += 1
        cached = self.bm.find_cached_prefix(seq)
        assert len(cached) <= (len(tokens) - 1) // BS
        for i, block_id in enumerate(cached):
            assert self.bm.blocks[block_id].token_ids == token_bytes(tokens[i * BS:(i + 1) * BS])
        if not self.bm.can_allocate(cached, len(tokens)):
            needed = -(-len(tokens) // BS) - len(cached) + sum(self.bm.blocks[b].ref_count == 0 for b in cached)
            assert needed > self.bm.num_free_blocks
            return
        free_before = self.bm.num_free_blocks
        self.bm.allocate(seq, cached, len(tokens))
        assert free_before - self.bm.num_free_blocks == len(seq.block_table) - sum(
            1 for b in cached if self.bm.blocks[b].ref_count > 1)
        seq.num_computed_tokens = len(tokens)
        self.bm.cache_full_blocks(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), new_tokens=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def grow_a_sequence(self, index: int, new_tokens: list[int]) -> None:
        seq = self.live[index % len(self.live)]
        target = len(seq.token_ids) + len(new_tokens)
        need = self.bm.num_new_blocks(seq, target)
        if need > self.bm.num_free_blocks:
            return
        self.bm.append_blocks(seq, need)
        seq.token_ids.extend(new_tokens)
        seq.num_computed_tokens = target
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def free_a_sequence(self, index: int) -> None:
        seq = self.live.pop(index % len(self.live))
        used_only_by_it = sum(1 for b in seq.block_table if self.bm.blocks[b].ref_count == 1)
        free_before = self.bm.num_free_blocks
        self.bm.free(seq)
        assert self.bm.num_free_blocks == free_before + used_only_by_it

    @invariant()
    def accounting_holds(self) -> None:
        self.bm.check_invariants(self.live)
        for h, block_id in self.bm.hash_to_block_id.items():
            assert self.bm.blocks[block_id].hash == h
        if not self.live:
            assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
