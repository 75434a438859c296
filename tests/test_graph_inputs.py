"""The decode graphs' static inputs (workers/graph_inputs.py), on CPU tensors: what one fill and one upload
leave in the device buffer, padding rows included, and the token ids the graph gathers from them."""

from __future__ import annotations

import numpy as np
import torch

from workers.graph_inputs import GraphInputs, decode_input_ids
from workers.input_batch import StepInputs

CPU = torch.device("cpu")


def decode_inputs(rows: list[int], seq_lens: list[int], on_device: list[int], block_size: int = 4) -> StepInputs:
    """A decode step of `rows` (batch rows) at `seq_lens`; the step indices in `on_device` take their token
    from the device (their previous token was sampled in the step before, not yet on the host)."""
    b = len(rows)
    positions = np.array(seq_lens, np.int64) - 1
    ids = np.array([100 + i for i in range(b)], np.int64)
    ids[on_device] = 0
    return StepInputs(
        input_ids=ids, positions=positions, slot_mapping=np.array([10 * r + p for r, p in zip(rows, positions)]),
        query_start_loc=np.arange(b + 1, dtype=np.int32), seq_lens=np.array(seq_lens, np.int32),
        rows=np.array(rows, np.int64), num_blocks_used=max(-(-n // block_size) for n in seq_lens),
        gpu_token_index=np.array(on_device, np.int64), gpu_token_rows=np.array(rows, np.int64)[on_device],
        logits_indices=np.arange(b, dtype=np.int64), sampling_rows=np.array(rows, np.int64), sampling_states=[],
        temperatures=np.resize(np.array([0.0, 0.7, 1.0], np.float32), b), seeded_rows=[], max_query_len=1,
        max_seq_len=max(seq_lens), is_decode=True)


def test_a_step_lands_at_fixed_offsets_with_its_padding_rows_neutral() -> None:
    io = GraphInputs(max_bs=8, max_blocks=5, scratch_row=16, device=CPU)
    table = np.arange(16 * 5, dtype=np.int32).reshape(16, 5)
    inputs = decode_inputs(rows=[7, 2, 11], seq_lens=[9, 3, 14], on_device=[0, 2])
    seeds = np.array([5, 6, 7], np.int64)
    for _ in range(3):  # both mirrors, and one reused: stale rows of an earlier step must not leak
        io.upload(*_fill(io, decode_inputs([1, 2, 3, 4, 5, 6], [4] * 6, []), table, 8))
        staging, nbytes, width = io.fill(inputs, table, 4, seeds)
        io.upload(staging, nbytes, 3, width)
        v = io.views
        assert width == 4 and v["input_ids"][:3].tolist() == [0, 101, 0]
        assert v["src_rows"][:4].tolist() == [7, -1, 11, -1]
        assert v["positions"][:4].tolist() == [8, 2, 13, 0]
        assert v["slot_mapping"][:4].tolist() == [78, 22, 123, -1]  # padding: no KV write
        assert v["seq_lens"][:4].tolist() == [9, 3, 14, 0]  # padding: no KV read
        assert v["sampling_rows"][:4].tolist() == [7, 2, 11, 16]  # padding samples into the scratch entry
        assert v["temperatures"][:4].tolist() == [0.0, np.float32(0.7), 1.0, 0.0]
        assert v["seeds"][:4].tolist() == [5, 6, 7, 0] and v["logits_indices"][:3].tolist() == [0, 1, 2]
        assert torch.equal(io.block_tables[:3, :4], torch.from_numpy(table[[7, 2, 11], :4]))
    greedy_only = io.fill(inputs, table, 4, None)
    io.upload(*greedy_only[:2], 3, greedy_only[2])
    assert io.views["seeds"][:4].tolist() == [0, 0, 0, 0]
    for name, (offset, _) in io.layout.items():
        assert offset % 16 == 0, name  # Triton specializes on 16-byte pointer alignment


def _fill(io: GraphInputs, inputs: StepInputs, table: np.ndarray, bs: int):
    staging, nbytes, width = io.fill(inputs, table, bs, None)
    return staging, nbytes, len(inputs.rows), width


def test_the_graph_takes_device_sampled_tokens_from_last_sampled() -> None:
    last_sampled = torch.tensor([40, 41, 42, 43, 99])  # rows 0..3 and the scratch entry
    ids = decode_input_ids(torch.tensor([7, 0, 0, 8]), torch.tensor([-1, 3, 0, -1]), last_sampled)
    assert ids.tolist() == [7, 43, 40, 8]
