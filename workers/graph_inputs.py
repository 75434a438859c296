"""The inputs of the decode CUDA graphs: one static device buffer at a fixed layout, filled by one copy.

A captured graph reads its inputs from fixed addresses. Copying a step's inputs into them one tensor at a
time cost the host seven copies, two fills and an index-put a step, each a launch the device waited for
at batch 1, where the host is what limits a step. Here every per-row input of a decode step lives at a
fixed offset of one device buffer (`GraphInputs.views`, `[max_bs]` each), and the block table's used
columns at the end of it: the host writes a step into a pinned mirror (two, alternating between steps)
and one host-to-device copy moves it; one device-side copy spreads the block table into the graph's
`[max_bs, max_blocks]` table.

Rows past the step's batch (up to the replayed graph's size) are padding: slot -1 (no KV write), sequence
length 0 (no KV read), temperature 0, and a sampling row that points at the scratch entry past the last
batch row of `last_sampled`, so a padding row's token lands nowhere.

The graph itself turns `src_rows` into the step's token ids (`decode_input_ids`): a row whose previous
token was sampled on the device (the pipelined step before it) reads it from `last_sampled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.host_buffers import TORCH_DTYPES, aligned
from workers.input_batch import StepInputs

# (name, dtype) of the per-row inputs, in buffer order; each holds max_bs entries.
FIELDS = (("input_ids", np.int64), ("src_rows", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
          ("logits_indices", np.int64), ("sampling_rows", np.int64), ("seeds", np.int64),
          ("seq_lens", np.int32), ("temperatures", np.float32))


@dataclass
class _Staging:
    """One pinned mirror of the device buffer and the event of the copy that last read it."""

    packed: torch.Tensor  # [nbytes] uint8, pinned on CUDA
    fields: dict[str, np.ndarray]  # numpy views of `packed`, [max_bs] each
    blocks: np.ndarray  # [max_bs * max_blocks] int32 view: the step's [b, width] table, row-major
    copied: torch.cuda.Event | None


def decode_input_ids(input_ids: torch.Tensor, src_rows: torch.Tensor, last_sampled: torch.Tensor) -> torch.Tensor:
    """Token ids of a decode step: `last_sampled[src_rows[i]]` where `src_rows[i] >= 0` (the token was sampled on
    the device and never reached the host), else `input_ids[i]`. All `[n]` int64 on one device (last_sampled
    `[rows]`); a fixed-shape computation, so it can be captured in a graph."""
    return torch.where(src_rows >= 0, last_sampled[src_rows.clamp(min=0)], input_ids)


class GraphInputs:
    """The static inputs of every decode graph of batch size <= `max_bs` (see the module docstring).

    `views[name]`: `[max_bs]` device tensors of FIELDS, `block_tables`: `[max_bs, max_blocks]` int32,
    `query_start_loc`: `[max_bs + 1]` int32 (0, 1, .., max_bs: one token a row), `tokens`: `[max_bs]` int64,
    where a graph that samples leaves its tokens. `scratch_row`: the index of `last_sampled`'s padding entry.
    """

    def __init__(self, max_bs: int, max_blocks: int, scratch_row: int, device: torch.device) -> None:
        self.max_bs, self.max_blocks, self.scratch_row, self.device = max_bs, max_blocks, scratch_row, device
        self.layout: dict[str, tuple[int, np.dtype]] = {}
        offset = 0
        for name, dtype in FIELDS:
            self.layout[name] = (offset, np.dtype(dtype))
            offset += aligned(max_bs * np.dtype(dtype).itemsize)
        self.fields_nbytes = offset
        self.nbytes = offset + max_bs * max_blocks * 4
        self.packed = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.views = {name: self.packed[o: o + max_bs * dt.itemsize].view(TORCH_DTYPES[dt])
                      for name, (o, dt) in self.layout.items()}
        self.views["slot_mapping"].fill_(-1)
        self.views["src_rows"].fill_(-1)
        self.views["sampling_rows"].fill_(scratch_row)
        self.block_region = self.packed[self.fields_nbytes:].view(torch.int32)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._staging = [self._make_staging(pin) for _ in range(2)]
        self._parity = 0

    def _make_staging(self, pin: bool) -> _Staging:
        packed = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        raw = packed.numpy()
        fields = {name: raw[o: o + self.max_bs * dt.itemsize].view(dt) for name, (o, dt) in self.layout.items()}
        return _Staging(packed, fields, raw[self.fields_nbytes:].view(np.int32),
                        torch.cuda.Event() if pin else None)

    def fill(self, inputs: StepInputs, block_table: np.ndarray, graph_bs: int, seeds: np.ndarray | None
             ) -> tuple[_Staging, int, int]:
        """Write a decode step of b <= graph_bs rows into the next pinned mirror, padding rows b..graph_bs.
        `block_table`: the batch's `[max_num_seqs, max_blocks]` int32 table (rows picked by `inputs.rows`);
        `seeds`: `[b]` int64 noise seeds, None for a step that draws none. Returns (mirror, bytes to copy,
        block-table width). Waits for the copy that last read this mirror (two steps ago)."""
        st = self._staging[self._parity]
        self._parity ^= 1
        if st.copied is not None:
            st.copied.synchronize()
        b = len(inputs.rows)
        assert inputs.is_decode and b <= graph_bs <= self.max_bs and len(inputs.positions) == b
        assert len(inputs.sampling_rows) == b, "every row of a decode step samples"
        f = st.fields
        f["input_ids"][:b] = inputs.input_ids
        src = f["src_rows"]
        src[:graph_bs] = -1
        src[inputs.gpu_token_index] = inputs.gpu_token_rows
        f["positions"][:b] = inputs.positions
        f["slot_mapping"][:b] = inputs.slot_mapping
        f["seq_lens"][:b] = inputs.seq_lens
        f["logits_indices"][:b] = inputs.logits_indices
        f["sampling_rows"][:b] = inputs.sampling_rows
        f["temperatures"][:b] = inputs.temperatures
        f["seeds"][:b] = 0 if seeds is None else seeds
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("seq_lens", 0),
                          ("logits_indices", 0), ("sampling_rows", self.scratch_row), ("temperatures", 0),
                          ("seeds", 0)):
            f[name][b:graph_bs] = pad
        width = max(1, inputs.num_blocks_used)
        st.blocks[: b * width] = block_table[inputs.rows, :width].reshape(-1)
        return st, self.fields_nbytes + b * width * 4, width

    def upload(self, st: _Staging, nbytes: int, b: int, width: int) -> None:
        """Copy a filled mirror to the device buffer (non-blocking from pinned memory) and its block table into
        the graph's table: two operations on the current stream."""
        self.packed[:nbytes].copy_(st.packed[:nbytes], non_blocking=True)
        if st.copied is not None:
            st.copied.record()
        self.block_tables[:b, :width].copy_(self.block_region[: b * width].view(b, width))
