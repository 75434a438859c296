"""Paged KV-cache block allocator with prefix caching.

The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block table
(a list of block ids); the token at position p lives in block `block_table[p // block_size]`.

Prefix caching (the idea of vLLM's automatic prefix caching and nano-vllm's block manager): a
full block is identified by a chained hash, xxh64(parent block's hash, its token ids), so equal
hashes mean equal prefixes. A full block whose KV has been scheduled is registered in
`hash_to_block_id`; a later sequence with the same prefix shares the block (reference counts)
instead of recomputing it. Every hit is verified against the block's stored token ids, so a
hash collision can never serve wrong KV.

Invariants (checked by `check_invariants`, used by the tests after every step):
- free and used blocks partition all blocks; a used block's `ref_count` is the number of live
  block tables holding it, a free block's is 0 and it is in no live block table;
- every hash-table entry points to a block whose stored hash is that key and whose stored token
  ids are the hashed ones;
- a block in the free queue keeps its hash until it is taken for new content; then its stale
  hash-table entry is removed (taking blocks from the front of the queue evicts the least
  recently freed first).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

import numpy as np
import xxhash

from scheduler_proc.free_block_queue import FreeBlockQueue
from scheduler_proc.sequence import Sequence

NO_HASH = -1


def token_bytes(token_ids: SequenceABC[int]) -> bytes:
    """One block's token ids as int32 LE bytes: what its hash covers, and how a cached block keeps them (97 bytes
    for 16 tokens, where a tuple of Python ints took 632: the index of a full cache holds one per block)."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def hash_block(token_ids: SequenceABC[int], parent_hash: int) -> int:
    """Chained 64-bit hash of one full block: xxh64(parent hash (8 bytes LE) + token ids (int32 LE))."""
    h = xxhash.xxh64()
    h.update(parent_hash.to_bytes(8, "little", signed=True))
    h.update(token_bytes(token_ids))
    return h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF  # keep it a non-negative msgpack/int64 value


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.parent_hash = NO_HASH
        self.token_ids = b""  # the tokens hashed into `hash`, as `token_bytes` (empty when unhashed)


class BlockManager:
    """Allocates KV-cache blocks to sequences; owns the prefix-cache hash table.

    Sizes are in blocks unless a name says tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free block ids: taken from the front, returned to the back (LRU).
        self.free_block_ids = FreeBlockQueue(num_blocks)
        self.hash_to_block_id: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def compute_block_hashes(self, seq: Sequence) -> list[int]:
        """Extend `seq.block_hashes` over every full block of its known tokens; return it."""
        bs = self.block_size
        hashes = seq.block_hashes
        tokens = seq.token_ids
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block(tokens[i * bs:(i + 1) * bs], hashes[-1] if hashes else NO_HASH))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s known tokens.

        At most `(num_tokens - 1) // block_size` blocks, so at least one token (the last) is
        always computed and produces the logits of the next token (scenario BR-01).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        hashes = self.compute_block_hashes(seq)
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.hash_to_block_id.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != token_bytes(seq.token_ids[i * bs:(i + 1) * bs]):
                break  # a hash collision: never serve another prefix's KV
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register each full block of `seq` whose tokens are known and whose KV is scheduled.

        If another block already holds the same prefix, that entry is kept and this block stays
        unregistered (it is freed normally); the table never points at two copies.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_ready = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        if num_ready <= seq.num_hashed_blocks:
            return
        hashes = self.compute_block_hashes(seq)
        for i in range(seq.num_hashed_blocks, num_ready):
            h = hashes[i]
            block = self.blocks[seq.block_table[i]]
            existing = self.hash_to_block_id.get(h)
            if existing is None:
                block.hash = h
                block.parent_hash = hashes[i - 1] if i else NO_HASH
                block.token_ids = token_bytes(seq.token_ids[i * bs:(i + 1) * bs])
                self.hash_to_block_id[h] = block.block_id
        seq.num_hashed_blocks = num_ready

    # ------------------------------------------------------------------ allocation
    def _take_free_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != NO_HASH:
            # The block gets new content: its old prefix is gone, drop the stale entry.
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = block.parent_hash = NO_HASH
            block.token_ids = b""
        block.ref_count = 1
        return block_id

    def can_allocate(self, cached_block_ids: Iterable[int], num_tokens: int) -> bool:
        """Whether a waiting sequence can take `cached_block_ids` and grow to `num_tokens`."""
        cached = list(cached_block_ids)
        # A cached block sitting in the free queue leaves the queue when it is reused.
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        new = max(0, self.blocks_needed(num_tokens) - len(cached))
        return new + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached_block_ids: list[int], num_tokens: int) -> None:
        """Give a waiting `seq` its cached prefix blocks plus new blocks up to `num_tokens` tokens.

        The caller checked `can_allocate`. Sets `seq.block_table`, `seq.num_hashed_blocks`.
        """
        assert not seq.block_table, "allocate() is for sequences without blocks"
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_block_ids)
        seq.num_hashed_blocks = len(cached_block_ids)
        for _ in range(self.blocks_needed(num_tokens) - len(cached_block_ids)):
            seq.block_table.append(self._take_free_block())

    def fork(self, parent: Sequence, child: Sequence, num_shared: int, copy_last: bool) -> None:
        """Give `child` (without blocks) `parent`'s first `num_shared` blocks, shared by reference count,
        and with `copy_last` a fresh block for its copy of the parent's next one (copy-on-write of a
        partial block; the caller checked a block is free). Sets `child.block_table`,
        `child.num_hashed_blocks`."""
        assert not child.block_table, "fork() is for sequences without blocks"
        shared = parent.block_table[:num_shared]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        if copy_last:
            child.block_table.append(self._take_free_block())
        child.num_hashed_blocks = min(parent.num_hashed_blocks, num_shared)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks a running `seq` lacks to hold `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def append_blocks(self, seq: Sequence, num_new: int) -> list[int]:
        """Append `num_new` fresh blocks to `seq` (the caller checked there are enough)."""
        new_ids = [self._take_free_block() for _ in range(num_new)]
        seq.block_table.extend(new_ids)
        return new_ids

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. Tail blocks go back first, so prefix blocks are evicted last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    # ------------------------------------------------------------------ checks
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Assert the block-accounting invariants (scenarios.md, BAI 1-3) for these live sequences."""
        refs: dict[int, int] = {}
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] = refs.get(block_id, 0) + 1
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        free = set(self.free_block_ids)
        assert not used & free, f"blocks both used and free: {sorted(used & free)}"
        assert len(used) + len(free) == self.num_blocks, "free + used != total blocks"
        for block in self.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but in {refs.get(block.block_id, 0)} tables")
        for h, block_id in self.hash_to_block_id.items():
            block = self.blocks[block_id]
            assert block.hash == h, f"hash entry {h} -> block {block_id} whose hash is {block.hash}"
            assert hash_block(np.frombuffer(block.token_ids, "<i4"), block.parent_hash) == h, (
                f"block {block_id} holds tokens that do not hash to its entry {h}")
