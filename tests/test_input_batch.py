"""workers/input_batch.py on the host: a steady decode batch reuses its processed rows instead of rebuilding them."""

from __future__ import annotations

import dataclasses

import numpy as np

from common.protocol import i32
from common.protocol.types import SamplingOptions
from common.protocol.worker import NewRequest, StepPlan
from workers.input_batch import InputBatch
from workers.logits_processing import build_processing


def new(seq_id: int, options: SamplingOptions | None, block: int) -> NewRequest:
    return NewRequest(seq_id, i32([11, 12, 13]), 0.7, None, i32([block]), 0, 3, options)


def step(batch: InputBatch, plan: StepPlan):
    scheduled = batch.apply(plan)
    inputs = batch.prepare(scheduled)
    for st in inputs.sampling_states:  # the sampled tokens reach the host
        st.tokens[st.num_tokens - 1] = 7
        st.num_tokens_cpu = st.num_tokens
    return inputs.processing


def assert_same_fields(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y), f.name


def test_a_steady_decode_batch_reuses_its_processed_rows_and_any_change_rebuilds_them() -> None:
    batch = InputBatch(max_num_seqs=8, max_model_len=64, max_blocks_per_seq=4, block_size=16, vocab_size=1000)
    filtered = SamplingOptions(top_p=0.9, top_k=50, logprobs=5)
    first = step(batch, StepPlan(0, new_requests=[new(1, filtered, 0), new(2, None, 1)]))
    second = step(batch, StepPlan(1, decode_seq_ids=i32([1, 2])))
    assert second is first  # the same requests in the same rows: built once
    states = [batch.reqs[1], batch.reqs[2]]
    temperatures = np.array([st.temperature for st in states], np.float32)
    assert_same_fields(second, build_processing(states, temperatures, 1000, np.array([st.row for st in states])))

    # Another request joins (its prefill samples first): rebuilt; the decode steps after it are rows in another
    # order, rebuilt once, then reused.
    third = step(batch, StepPlan(2, new_requests=[new(3, SamplingOptions(min_p=0.1), 2)], decode_seq_ids=i32([1, 2])))
    assert third is not first and list(third.rows) == [0, 1]
    fourth = step(batch, StepPlan(3, decode_seq_ids=i32([1, 2, 3])))
    assert fourth is not third and list(fourth.rows) == [0, 2]
    assert step(batch, StepPlan(4, decode_seq_ids=i32([1, 2, 3]))) is fourth
    # One finishes: the rows differ.
    fifth = step(batch, StepPlan(5, finished_seq_ids=i32([2]), decode_seq_ids=i32([1, 3])))
    assert fifth is not fourth and list(fifth.rows) == [0, 1]

    # A request with sparse entries (min_tokens bans follow its output length) is rebuilt every step.
    banned = SamplingOptions(min_tokens=3, stop_token_ids=[9])
    step(batch, StepPlan(6, new_requests=[new(4, banned, 3)], decode_seq_ids=i32([1, 3])))
    seventh = step(batch, StepPlan(7, decode_seq_ids=i32([1, 3, 4])))
    eighth = step(batch, StepPlan(8, decode_seq_ids=i32([1, 3, 4])))
    assert eighth is not seventh and list(eighth.ban_tokens) == [9]
    for i in range(2):
        last = step(batch, StepPlan(9 + i, decode_seq_ids=i32([1, 3, 4])))
    assert len(last.ban_tokens) == 0  # min_tokens reached: no ban any more


def test_constrained_rows_are_reused_with_their_matchers() -> None:
    """A steady batch of constrained requests reuses its processed rows: the grammar rows and their matchers are
    the same objects every step (the bitmask is filled from the matchers each step); a new request rebuilds."""
    matchers = []

    def new_grammar(grammar_id: int, end: int, start: int) -> object:
        matchers.append(object())
        return matchers[-1]

    batch = InputBatch(max_num_seqs=8, max_model_len=64, max_blocks_per_seq=4, block_size=16, vocab_size=1000,
                       new_grammar=new_grammar)
    constrained = SamplingOptions(grammar_id=0)
    step(batch, StepPlan(0, new_requests=[new(1, constrained, 0), new(2, None, 1)]))
    first = step(batch, StepPlan(1, decode_seq_ids=i32([1, 2])))
    assert step(batch, StepPlan(2, decode_seq_ids=i32([1, 2]))) is first
    assert list(first.grammar_rows) == [0] and first.grammars == [matchers[0]]
    joined = step(batch, StepPlan(3, new_requests=[new(3, constrained, 2)], decode_seq_ids=i32([1, 2])))
    assert joined is not first
    steady = step(batch, StepPlan(4, decode_seq_ids=i32([1, 2, 3])))
    assert steady.grammars == matchers and step(batch, StepPlan(5, decode_seq_ids=i32([1, 2, 3]))) is steady
