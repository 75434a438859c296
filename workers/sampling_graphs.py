"""Processed rows inside a decode step's CUDA graph: the fused sampler's static inputs and how a step fills them.

A decode step with processed rows (filters, penalties, logit bias, bans, a grammar or logprobs) replays its forward
graph and then a third graph of the same batch size (workers/cuda_graphs.py): the LM head and `processed_sample` over
every row, reading its per-row parameters from the static tensors here. So the launches a step makes do not depend
on the mix of its rows: one copy of the parameters and sparse entries (and one of the grammar rows' bitmask, when
there are any) before the replays, and the copies of the outputs after.

Layout: one device buffer (and two pinned host mirrors that alternate between steps) holding, for `max_bs` rows,
`ProcessedParams`' tables (`floats [max_bs, 8]`, `ints [max_bs, 8]`), the sparse entries' CSR (`offsets
[max_bs + 1]` over at most `max_entries` entries of token, bias and ban condition); the grammar bitmask
`[max_bs, ceil(vocab / 32)]` int32 is a tensor of its own, written by a device copy of the step's grammar rows.
Rows past a step's batch are padding: greedy rows with nothing to process (no penalty state, grammar, scratch row
or logprobs), whose token lands in `last_sampled`'s scratch entry. A step with more sparse entries than
`max_entries` samples eagerly instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.sampling_params import MAX_LOGPROBS
from gpu_kernels.sampling_inputs import (
    BAN_NONE,
    NUM_FLOAT_COLUMNS,
    NUM_INT_COLUMNS,
    ProcessedParams,
    SparseEntries,
    processing_host,
)
from workers.host_buffers import TORCH_DTYPES, aligned
from workers.logits_processing import ProcessingInputs

MAX_GRAPH_ENTRIES = 4096  # sparse entries (logit bias, bans) a step can carry into the graph; more sample eagerly
GRAPH_NUM_TOP = MAX_LOGPROBS  # every graph reports this many top logprobs; a row reads its own first N


def _padding_rows(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """`ProcessedParams` tables of `rows` padding rows: greedy, nothing to process, every reference -1."""
    return ProcessedParams.pack(np.zeros(rows, np.float32), 1)


@dataclass
class HostMirror:
    """One pinned host mirror of the device buffer, its numpy views, and the event of its last copy."""

    packed: torch.Tensor  # [nbytes] uint8, pinned on CUDA
    views: dict[str, np.ndarray]
    copied: torch.cuda.Event | None


class ProcessedGraphInputs:
    """The static inputs of the processed-sampling graphs of batch size <= `max_bs` (module docstring).

    `params`: `ProcessedParams` over the `[max_bs, 8]` tables (a graph of size bs reads rows :bs); `sparse`:
    `SparseEntries` whose offsets hold `max_bs + 1` entries; `bitmask`: `[max_bs, ceil(vocab_size / 32)]` int32.
    """

    def __init__(self, max_bs: int, vocab_size: int, device: torch.device,
                 max_entries: int = MAX_GRAPH_ENTRIES) -> None:
        self.max_bs, self.vocab_size, self.device, self.max_entries = max_bs, vocab_size, device, max_entries
        shapes = {"floats": ((max_bs, NUM_FLOAT_COLUMNS), np.float32), "ints": ((max_bs, NUM_INT_COLUMNS), np.int32),
                  "offsets": ((max_bs + 1,), np.int32), "tokens": ((max_entries,), np.int32),
                  "bias": ((max_entries,), np.float32), "ban_after": ((max_entries,), np.int64)}
        self.layout: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        offset = 0
        for name, (shape, dtype) in shapes.items():
            self.layout[name] = (offset, shape, np.dtype(dtype))
            offset += aligned(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self.nbytes = offset
        self.packed = torch.zeros(offset, dtype=torch.uint8, device=device)
        self.views = {name: self.packed[o: o + int(np.prod(shape)) * dt.itemsize].view(TORCH_DTYPES[dt]).view(shape)
                      for name, (o, shape, dt) in self.layout.items()}
        v = self.views
        self.params = ProcessedParams(v["floats"], v["ints"])
        self.sparse = SparseEntries(v["offsets"], v["tokens"], v["bias"], v["ban_after"], np.zeros(0, np.int32))
        self.bitmask = torch.full((max_bs, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._mirrors = [self._make_mirror(pin) for _ in range(2)]
        self._parity = 0
        self._last_host: tuple[ProcessingInputs, np.ndarray, tuple] | None = None  # `fill`'s last host tables
        self.reset()

    def _make_mirror(self, pin: bool) -> HostMirror:
        packed = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        raw = packed.numpy()
        views = {name: raw[o: o + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
                 for name, (o, shape, dt) in self.layout.items()}
        return HostMirror(packed, views, torch.cuda.Event() if pin else None)

    def reset(self) -> None:
        """Every row a padding row, no entries (what a capture's warm-up reads: it must record no penalty state)."""
        floats, ints = _padding_rows(self.max_bs)
        self.views["floats"].copy_(torch.from_numpy(floats))
        self.views["ints"].copy_(torch.from_numpy(ints))
        self.views["offsets"].zero_()
        self.views["ban_after"].fill_(BAN_NONE)

    def fill(self, h: ProcessingInputs, temperatures: np.ndarray, graph_bs: int) -> HostMirror | None:
        """Write a decode step of b <= graph_bs rows (its processed rows `h`, the temperatures `[b]` float32 of all
        its rows, 0 = greedy) into the next pinned mirror, rows b..graph_bs as padding. None when its sparse entries
        do not fit (`max_entries`): the step samples eagerly. Waits for the copy that last read this mirror."""
        last = self._last_host
        if last is not None and last[0] is h and np.array_equal(last[1], temperatures):
            floats, ints, sparse = last[2]  # the same processed rows as the last step (`InputBatch._processing`)
        else:
            floats, ints, sparse = processing_host(h, temperatures, self.vocab_size)
            self._last_host = (h, temperatures.copy(), (floats, ints, sparse))
        entries = len(sparse.tokens)
        if entries > self.max_entries:
            return None
        m = self._mirrors[self._parity]
        self._parity ^= 1
        if m.copied is not None:
            m.copied.synchronize()
        b = len(temperatures)
        assert b <= graph_bs <= self.max_bs
        v = m.views
        v["floats"][:b], v["ints"][:b] = floats, ints
        v["floats"][b:graph_bs], v["ints"][b:graph_bs] = _padding_rows(graph_bs - b)
        v["offsets"][: b + 1] = sparse.offsets
        v["offsets"][b + 1: graph_bs + 1] = sparse.offsets[-1]
        v["tokens"][:entries], v["bias"][:entries], v["ban_after"][:entries] = \
            sparse.tokens, sparse.bias, sparse.ban_after
        return m

    def upload(self, m: HostMirror) -> None:
        """Copy a filled mirror to the device buffer (one non-blocking copy from pinned memory)."""
        self.packed.copy_(m.packed, non_blocking=True)
        if m.copied is not None:
            m.copied.record()

    def set_bitmask(self, bitmask: torch.Tensor) -> None:
        """The step's grammar rows' masks `[G, words]` int32 (on the device) into rows :G (a device copy)."""
        self.bitmask[: bitmask.shape[0]].copy_(bitmask, non_blocking=True)

