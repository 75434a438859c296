"""The scheduler-side failure scenarios of ../shared/scenarios.md, on the fake worker.

Lengths are scaled from the scenarios' block size 256 to block size 16 (divided by 16, keeping the
same block multiples): a "512-token prompt" is 32 tokens here, a 600-token prompt (2 full blocks +
88) is 38 tokens (2 full blocks + 6), `max_model_len` 1024 is 64. "Baseline output" is the hash
model's reference output (`reference_output`), which is what an engine with ample cache, no prefix
hits and no chunking produces; some tests also run that baseline engine explicitly.

The fake worker asserts on every step that no slot is read before it is written, every write lands
in the sequence's own blocks, every KV entry read was computed for the reader's prefix, and the
block accounting invariants (BAI 1-3) hold; `run_until_done` asserts BAI 4 and that neither side
keeps per-request state. The last section shows that the harness does catch the faults described.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.protocol import EngineRequest
from scheduler_proc import block_manager as block_manager_module
from scheduler_proc.block_manager import BlockManager, token_bytes
from scheduler_proc.scheduler import SchedulerConfig
from tests.fake_worker import FakeEngine, make_request, reference_output, run, synthetic_prompt
from workers.input_batch import InputBatch

B = 16  # block size: the scenarios' 256 / 16


def cfg(**overrides: object) -> SchedulerConfig:
    """An ample engine: 256 blocks, no chunking (scenarios' max_model_len 4096 and budget 8192, scaled)."""
    values: dict = dict(num_kv_blocks=256, block_size=B, max_model_len=256, max_num_seqs=256,
                        max_num_batched_tokens=8192)
    values.update(overrides)
    return SchedulerConfig(**values)


def greedy(seq_id: int, prompt: list[int], max_tokens: int) -> EngineRequest:
    """Greedy, ignore_eos: no stop token ids."""
    return make_request(seq_id, prompt, max_tokens)


def baseline(prompt: list[int], max_tokens: int, max_model_len: int = 256) -> list[int]:
    return reference_output(prompt, max_tokens, max_model_len=max_model_len)[0]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ============================================================================ BR-01
@pytest.mark.parametrize(("prompt_len", "cached"), [(32, 16), (16, 0), (48, 32)])
def test_br01_rerun_of_a_block_multiple_prompt_recomputes_its_last_block(prompt_len: int, cached: int) -> None:
    prompt = synthetic_prompt(prompt_len, seed=1)
    engine = FakeEngine(cfg())
    engine.add(greedy(0, prompt, 16))
    engine.run_until_done()
    engine.add(greedy(1, prompt, 16))
    engine.run_until_done()

    assert engine.num_cached_tokens == {0: 0, 1: cached}
    (second,) = [r for s in engine.steps for r in s.rows if r.seq_id == 1 and r.kind == "new"]
    assert (second.start, second.num_tokens) == (cached, prompt_len - cached)
    assert engine.outputs[1] == engine.outputs[0] == baseline(prompt, 16)


def test_br01_same_prompt_twice_in_one_call_then_alone() -> None:
    prompt = synthetic_prompt(32, seed=2)
    engine = run([greedy(0, prompt, 16), greedy(1, prompt, 16)], cfg())
    engine.add(greedy(2, prompt, 16))
    engine.run_until_done()

    # The second copy shares the first block that the first copy registers in the same step: every
    # layer stores the batch's KV before attending, so the block is written before it is read.
    assert engine.num_cached_tokens == {0: 0, 1: 16, 2: 16}
    assert engine.outputs[0] == engine.outputs[1] == engine.outputs[2] == baseline(prompt, 16)


# ============================================================================ BR-02
def test_br02_reused_block_never_serves_its_old_prefix() -> None:
    engine = FakeEngine(cfg(num_kv_blocks=4))
    x = synthetic_prompt(B, seed=10)
    a_prompt = x + synthetic_prompt(2, seed=11)  # X (256 tokens) + 20 more, scaled
    engine.add(greedy(0, a_prompt, 8))
    engine.run_until_done()
    x_block = engine.steps[0].rows[0].block_table[0]
    assert engine.scheduler.block_manager.blocks[x_block].token_ids == token_bytes(x)  # free but hashed

    for i in (1, 2, 3):
        engine.add(greedy(i, synthetic_prompt(19, seed=20 + i), 8))  # 300 tokens, scaled
    engine.run_until_done()
    b_blocks = {b for s in engine.steps for r in s.rows if r.seq_id in (1, 2, 3) for b in r.block_table}
    assert b_blocks == {0, 1, 2, 3}  # every block, X's included, was reallocated
    bm = engine.scheduler.block_manager
    assert all(bm.blocks[b].token_ids != token_bytes(x) for b in bm.hash_to_block_id.values())
    engine.worker.check_hashed_blocks(engine.scheduler)  # BAI (3), against the cache content

    engine.add(greedy(4, a_prompt, 8))
    engine.scheduler_iteration()
    (new,) = [r for s in engine.steps for r in s.plan.new_requests if r.seq_id == 4]
    hit_blocks = new.block_ids[: new.num_computed_tokens // B].tolist()
    for block in hit_blocks:  # a hit must be a block that holds X now
        assert engine.worker.kv_tokens[block * B:(block + 1) * B].tolist() == x
    engine.worker_iteration()
    engine.run_until_done()

    assert engine.num_cached_tokens[4] == 0  # X's block was overwritten
    assert engine.outputs[4] == engine.outputs[0] == baseline(a_prompt, 8)


# ============================================================================ BR-04
def test_br04_identical_prompts_in_one_step_share_blocks_and_the_third_run_hits() -> None:
    prompt = synthetic_prompt(38, seed=30)  # 600 tokens: 2 full blocks + 88, scaled
    other = synthetic_prompt(19, seed=31)
    engine = run([greedy(0, prompt, 32), greedy(1, prompt, 32), greedy(2, other, 32)], cfg())

    first = engine.steps[0]
    tables = {r.seq_id: r.block_table for r in first.rows}
    assert first.admitted_seq_ids == [0, 1, 2]
    assert tables[1][:2] == tables[0][:2] and tables[1][2] != tables[0][2]  # no duplicate KV for the prefix
    bm = engine.scheduler.block_manager
    registered = list(bm.hash_to_block_id.values())
    assert len(registered) == len(set(registered))  # one block per hash, one hash per block
    full_blocks = [token_bytes(prompt[i * B:(i + 1) * B]) for i in range(2)]
    assert [sum(bm.blocks[b].token_ids == t for b in registered) for t in full_blocks] == [1, 1]
    engine.worker.check_hashed_blocks(engine.scheduler)

    engine.add(greedy(3, prompt, 32))
    engine.run_until_done()
    assert engine.num_cached_tokens == {0: 0, 1: 32, 2: 0, 3: 32}
    want = baseline(prompt, 32)
    assert engine.outputs[0] == engine.outputs[1] == engine.outputs[3] == want
    assert engine.outputs[2] == baseline(other, 32)


@pytest.mark.parametrize("num_kv_blocks", [18, 12])
def test_br04_eight_copies_decoding_while_blocks_are_freed_and_reused(num_kv_blocks: int) -> None:
    # 8 copies of 38 tokens + 19 outputs (300, scaled): 2 shared blocks + 2 own blocks each = 18.
    prompt = synthetic_prompt(38, seed=32)
    engine = run([greedy(i, prompt, 19) for i in range(8)], cfg(num_kv_blocks=num_kv_blocks))

    want = baseline(prompt, 19)
    assert all(out == want for out in engine.outputs.values())
    if num_kv_blocks < 18:
        assert engine.num_preemptions > 0
    else:
        assert engine.num_preemptions == 0 and min(s.num_free_blocks for s in engine.steps) == 0


# ============================================================================ BR-06
def assert_prefills_inside_the_sequence_and_its_blocks(engine: FakeEngine) -> None:
    for s in engine.steps:
        for r in s.rows:
            assert r.start + r.num_tokens <= r.known_tokens, (s.step_id, r)
            assert len(r.block_table) == ceil_div(r.start + r.num_tokens, B), (s.step_id, r)


def test_br06_preempted_requests_readmitted_with_prefix_hits() -> None:
    shared = synthetic_prompt(B, seed=40)
    reqs = [greedy(i, shared + synthetic_prompt(3, seed=100 + i), 38) for i in range(16)]  # 300 / 600, scaled
    engine = run(reqs, cfg(num_kv_blocks=24, max_num_batched_tokens=256), max_steps=5000)

    assert engine.num_preemptions > 0
    resumed = [r for s in engine.steps for r in s.rows if r.kind == "resumed"]
    assert resumed and any(r.start > 0 for r in resumed)  # hits on their own (or shared) former blocks
    assert_prefills_inside_the_sequence_and_its_blocks(engine)
    engine.assert_matches_reference()


def test_br06_256_random_requests_on_a_normal_cache() -> None:
    gen = np.random.default_rng(41)
    reqs = [greedy(i, synthetic_prompt(int(gen.integers(6, 64)), seed=1000 + i), int(gen.integers(1, 24)))
            for i in range(256)]
    engine = run(reqs, cfg(num_kv_blocks=512, max_num_batched_tokens=512))

    assert_prefills_inside_the_sequence_and_its_blocks(engine)
    engine.assert_matches_reference()


# ============================================================================ BR-08
def test_br08_each_chunk_attends_over_exactly_the_tokens_computed_so_far() -> None:
    prompt = synthetic_prompt(62, seed=50)  # 1000 tokens, scaled: 4 chunks of a 256-token budget
    engine = run([greedy(0, prompt, 16)], cfg(max_num_batched_tokens=B))

    chunks = [(s, r) for s in engine.steps for r in s.rows if r.kind in ("new", "prefill")]
    assert [(r.start, r.num_tokens) for _, r in chunks] == [(0, 16), (16, 16), (32, 16), (48, 14)]
    for s, r in chunks:
        assert s.seq_lens == [r.start + r.num_tokens]  # key length of the chunk
    unchunked = run([greedy(0, prompt, 16)], cfg())
    assert engine.outputs[0] == unchunked.outputs[0] == baseline(prompt, 16)


def test_br08_second_long_prompt_arrives_mid_chunk() -> None:
    first, second = synthetic_prompt(62, seed=51), synthetic_prompt(62, seed=52)
    engine = FakeEngine(cfg(max_num_batched_tokens=B))
    engine.add(greedy(0, first, 16))
    engine.step()
    engine.add(greedy(1, second, 16))
    engine.run_until_done()

    for s in engine.steps:
        for r, key_len in zip(s.rows, s.seq_lens):
            assert key_len == r.start + r.num_tokens
    assert sum(1 for s in engine.steps for r in s.rows if r.seq_id == 1 and not r.samples) >= 3  # chunked
    assert engine.outputs == {0: baseline(first, 16), 1: baseline(second, 16)}


# ============================================================================ BR-10
def assert_blocks_allocated_exactly_when_first_written(engine: FakeEngine) -> None:
    """Each step's table covers the positions it writes and not one block more."""
    for s in engine.steps:
        for r in s.rows:
            assert len(r.block_table) == ceil_div(r.start + r.num_tokens, B), (s.step_id, r)
            assert s.block_table_lens[r.seq_id] == len(r.block_table)


def assert_blocks_after_every_step(engine: FakeEngine) -> None:
    """Scenario's rule (one step in flight): after k outputs a p-token prompt owns ceil((p + k - 1) / B) blocks."""
    for result in engine.results:
        assert result.num_in_flight == 0
        for seq_id, (p, k, blocks) in result.seqs.items():
            assert blocks == ceil_div(p + k - 1, B), (seq_id, p, k, blocks)


BR10_FITS = [(2, 15, 2), (2, 16, 2), (2, 17, 2), (2, 31, 2), (2, 32, 1), (2, 10, 23), (1, 16, 1)]
BR10_TOO_LONG = [(2, 32, 2, 1), (2, 10, 24, 23), (1, 16, 2, 1)]  # (blocks, prompt, max_tokens, tokens that fit)


@pytest.mark.parametrize("max_steps_in_flight", [1, 2])
@pytest.mark.parametrize(("num_kv_blocks", "prompt_len", "max_tokens"), BR10_FITS)
def test_br10_decode_gets_its_new_block_in_the_step_writing_the_blocks_first_position(
        num_kv_blocks: int, prompt_len: int, max_tokens: int, max_steps_in_flight: int) -> None:
    prompt = synthetic_prompt(prompt_len, seed=prompt_len)
    engine = run([greedy(0, prompt, max_tokens)],
                 cfg(num_kv_blocks=num_kv_blocks, max_steps_in_flight=max_steps_in_flight),
                 max_steps=prompt_len + max_tokens)

    assert engine.outputs[0] == baseline(prompt, max_tokens) and engine.finish_reasons[0] == "length"
    assert_blocks_allocated_exactly_when_first_written(engine)
    if max_steps_in_flight == 1:
        assert_blocks_after_every_step(engine)
    assert max(s.block_table_lens.get(0, 0) for s in engine.steps) == ceil_div(prompt_len + max_tokens - 1, B)


@pytest.mark.parametrize(("max_steps_in_flight", "interleaving"), [
    (2, "lazy"), (2, "eager"), (1, "lazy")])
@pytest.mark.parametrize(("num_kv_blocks", "prompt_len", "max_tokens", "fit"), BR10_TOO_LONG)
def test_br10_request_longer_than_the_cache_stops_at_the_last_token_that_fits(
        num_kv_blocks: int, prompt_len: int, max_tokens: int, fit: int, max_steps_in_flight: int,
        interleaving: str) -> None:
    prompt = synthetic_prompt(prompt_len, seed=prompt_len)
    engine = run([greedy(0, prompt, max_tokens)],
                 cfg(num_kv_blocks=num_kv_blocks, max_steps_in_flight=max_steps_in_flight),
                 max_steps=prompt_len + max_tokens, interleaving=interleaving)

    assert engine.finish_reasons[0] == "length"
    assert engine.outputs[0] == baseline(prompt, max_tokens)[:fit]
    assert prompt_len + fit == num_kv_blocks * B + 1  # the last token needs no KV slot
    assert_blocks_allocated_exactly_when_first_written(engine)
    assert max(s.block_table_lens.get(0, 0) for s in engine.steps) == num_kv_blocks


# ============================================================================ BR-13
def test_br13_request_larger_than_the_whole_cache_fails_fast_and_others_complete() -> None:
    engine = FakeEngine(cfg(num_kv_blocks=4, max_model_len=256))  # 1024 KV tokens, max_model_len 4096, scaled
    small_1, big, small_2 = synthetic_prompt(6, seed=60), synthetic_prompt(94, seed=61), synthetic_prompt(6, seed=62)
    assert engine.add(greedy(0, small_1, 8)) is None
    error = engine.add(greedy(1, big, 8))
    assert engine.add(greedy(2, small_2, 8)) is None

    assert error is not None and error.reason == "error"
    assert "needs 6 KV-cache blocks" in error.error and "only 4 blocks" in error.error
    engine.run_until_done(max_steps=100)
    assert engine.outputs == {0: baseline(small_1, 8), 1: [], 2: baseline(small_2, 8)}


def test_br13_oversized_request_alone_leaves_the_engine_idle() -> None:
    engine = FakeEngine(cfg(num_kv_blocks=4))
    error = engine.add(greedy(0, synthetic_prompt(94, seed=61), 8))

    assert error is not None and "6" in error.error and "4" in error.error
    assert engine.scheduler.schedule() is None and not engine.scheduler.seqs
    engine.run_until_done(max_steps=1)


# ============================================================================ BR-14
@pytest.mark.parametrize("budget", [8192, B])  # part 4: the same with chunked prefill
def test_br14_every_length_limit(budget: int) -> None:
    engine = FakeEngine(cfg(max_model_len=64, max_num_batched_tokens=budget))  # max_model_len 1024, scaled

    over = engine.add(greedy(0, synthetic_prompt(65, seed=70), 8))
    assert over is not None and "65 tokens" in over.error and "max_model_len is 64" in over.error
    at = engine.add(greedy(1, synthetic_prompt(64, seed=71), 8))  # documented: rejected like (1)
    assert at is not None and "64 tokens" in at.error and "max_model_len is 64" in at.error
    assert not engine.scheduler.seqs
    prompt = synthetic_prompt(40, seed=72)  # 1000 + 100 on 1024: 24 new tokens (scaled: 40 + 100 on 64)
    engine.add(greedy(2, prompt, 100))
    engine.run_until_done(max_steps=100)

    assert engine.finish_reasons == {0: "error", 1: "error", 2: "length"}
    assert len(prompt) + len(engine.outputs[2]) == 64 and len(engine.outputs[2]) == 24
    assert max(r.start + r.num_tokens for s in engine.steps for r in s.rows) == 63  # the last token needs no KV
    assert engine.outputs[2] == baseline(prompt, 100, max_model_len=64)


# ============================================================================ BR-15
def test_br15_empty_prompt_is_rejected_and_the_others_run() -> None:
    engine = FakeEngine(cfg())
    hello, world = synthetic_prompt(3, seed=80), synthetic_prompt(2, seed=81)
    assert engine.add(greedy(0, hello, 8)) is None
    empty = engine.add(greedy(1, [], 8))
    assert engine.add(greedy(2, world, 8)) is None
    engine.run_until_done()

    assert empty is not None and empty.reason == "error" and "empty" in empty.error
    engine.add(greedy(3, hello, 8))
    engine.run_until_done()
    assert engine.outputs == {0: baseline(hello, 8), 1: [], 2: baseline(world, 8), 3: baseline(hello, 8)}


# ============================================================================ BR-16
@pytest.mark.parametrize("budget", [8192, B])
def test_br16_requests_finishing_at_prefill_leak_nothing(budget: int) -> None:
    gen = np.random.default_rng(90)
    prompts = [synthetic_prompt(int(gen.integers(6, 45)), seed=2000 + i) for i in range(200)]  # 100-700, scaled
    engine = run([greedy(i, p, 1) for i, p in enumerate(prompts)], cfg(max_num_batched_tokens=budget))

    assert engine.outputs == {i: baseline(p, 1) for i, p in enumerate(prompts)}
    chunk_rows = [r for s in engine.steps for r in s.rows]
    assert sum(r.samples for r in chunk_rows) == 200  # non-final chunks sample nothing
    if budget == B:
        assert len(chunk_rows) > 200
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.seqs and not engine.worker.batch.reqs

    normal = synthetic_prompt(20, seed=3000)
    engine.add(greedy(500, normal, 32))
    engine.run_until_done()
    assert engine.outputs[500] == baseline(normal, 32)


# ============================================================================ BR-18
def test_br18_four_requests_in_eight_blocks_all_complete() -> None:
    # 256-token prompts and 1024 outputs, scaled: each needs 5 blocks, together 20 > 8.
    reqs = [greedy(i, synthetic_prompt(B, seed=100 + i), 64) for i in range(4)]
    engine = run(reqs, cfg(num_kv_blocks=8), max_steps=1000)

    engine.assert_matches_reference()
    assert all(len(out) == 64 for out in engine.outputs.values())
    assert 0 < engine.num_preemptions < 20
    assert 0 not in [p for s in engine.steps for p in s.preempted_seq_ids]
    for s in engine.steps:
        assert not (s.preempted_seq_ids and s.admitted_seq_ids)


@pytest.mark.parametrize(("prompt_len", "interleaving"), [
    (B, "lazy"), (B + 1, "lazy"), (B, "eager"),
    (B + 1, "eager")])
def test_br18_request_that_can_never_fit_ends_with_length(prompt_len: int, interleaving: str) -> None:
    prompt = synthetic_prompt(prompt_len, seed=110)
    engine = run([greedy(0, prompt, 156)], cfg(num_kv_blocks=8), max_steps=200,  # 2500 outputs, scaled
                 interleaving=interleaving)

    assert engine.finish_reasons == {0: "length"}
    assert prompt_len + len(engine.outputs[0]) == 8 * B + 1
    assert engine.outputs[0] == baseline(prompt, 156)[: 8 * B + 1 - prompt_len]
    assert engine.num_preemptions == 0


# ============================================================================ the harness catches the faults
def test_harness_catches_attention_over_the_whole_sequence_in_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """BR-08's fault: key length = the whole prompt instead of start + chunk length."""
    prepare = InputBatch.prepare

    def whole_sequence_keys(self: InputBatch, scheduled: list) -> object:
        inputs = prepare(self, scheduled)
        inputs.seq_lens[:] = [st.num_tokens - (1 if st in inputs.sampling_states else 0) for st, _ in scheduled]
        return inputs

    monkeypatch.setattr(InputBatch, "prepare", whole_sequence_keys)
    with pytest.raises(AssertionError, match="key length"):
        run([greedy(0, synthetic_prompt(62, seed=50), 4)], cfg(max_num_batched_tokens=B))


def test_harness_catches_a_stale_hash_entry_left_on_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """BR-02's fault: a reused block keeps its old hash-table entry (and no token check at lookup)."""

    def take_without_eviction(self: BlockManager) -> int:
        block_id = next(iter(self.free_block_ids))
        del self.free_block_ids[block_id]
        self.blocks[block_id].ref_count = 1
        return block_id

    monkeypatch.setattr(BlockManager, "_take_free_block", take_without_eviction)
    monkeypatch.setattr(BlockManager, "check_invariants", lambda self, live: None)  # only the worker checks
    x = synthetic_prompt(B, seed=10)
    engine = FakeEngine(cfg(num_kv_blocks=4))
    engine.add(greedy(0, x + [1, 2], 8))
    engine.run_until_done()
    for i in (1, 2, 3):
        engine.add(greedy(i, synthetic_prompt(19, seed=20 + i), 8))
    with pytest.raises(AssertionError, match="hash entries point at blocks"):
        engine.run_until_done()


def test_harness_catches_a_block_allocated_one_token_too_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """BR-10's fault: the new block is allocated in the step after the one writing its first position."""
    monkeypatch.setattr(block_manager_module.BlockManager, "num_new_blocks",
                        lambda self, seq, num_tokens: max(0, self.blocks_needed(num_tokens - 1) - len(seq.block_table)))
    with pytest.raises(AssertionError):
        run([greedy(0, synthetic_prompt(15, seed=15), 4)], cfg(num_kv_blocks=2), check_invariants=False)
