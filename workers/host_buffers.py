"""Host memory on its way to the device and back: a step's pinned staging buffers, and the packing rules.

An eager step's inputs are packed into one buffer (`HostBuffers`, each input at a multiple of `PACK_ALIGN` bytes)
and go to the device in one copy. A decode step that replays a CUDA graph copies its inputs through the graphs'
static buffer instead (workers/graph_inputs.py, packed by the same rules); every step's tokens come back through
`HostBuffers.sampled`. `to_device` is the asynchronous copy of any other host array.
"""

from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                np.dtype(np.float32): torch.float32}
# Bytes: every input packed into one buffer (a step's eager inputs here, a decode graph's in
# workers/graph_inputs.py) starts at a multiple. Triton specializes a kernel on whether each pointer argument is
# 16-byte aligned, so the views must be aligned alike at every batch: at 8 bytes their alignment changed with the
# step's sizes, and each new combination compiled the prefill and sampling kernels anew mid-run (steps of 0.4-1.9 s
# on the H200, 6 s of a 12.9 s reference run; benchmarks/RESULTS.md, 2026-12-02 third session).
PACK_ALIGN = 16
# A step's inputs, in the order and dtype they are packed for the device (`HostBuffers.pack`); `StepInputs` fields
# of these names, but for "block_tables" (the scheduled rows of the batch's block table).
UPLOADS = (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
           ("query_start_loc", np.int32), ("seq_lens", np.int32), ("block_tables", np.int32),
           ("gpu_token_index", np.int64), ("gpu_token_rows", np.int64), ("logits_indices", np.int64),
           ("sampling_rows", np.int64), ("temperatures", np.float32))
# The step's index inputs, uploaded beside the model's (`dev_idx`): which token ids come from `last_sampled`, and the
# sampling rows' logits indices, batch rows and temperatures.
INDEX_INPUTS = ("gpu_token_index", "gpu_token_rows", "logits_indices", "sampling_rows", "temperatures")


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of PACK_ALIGN."""
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device (an asynchronous copy on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class HostBuffers:
    """Pinned host staging memory for one step's inputs (two sets alternate between steps, so a step
    never overwrites memory whose copy to the device may not have run yet), and for its sampled tokens.

    All of a step's inputs are packed into one byte buffer and go to the device in one copy: at batch 1
    a step's eleven separate copies cost more host time than the device spends on them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        capacity = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                    "query_start_loc": max_seqs + 1, "seq_lens": max_seqs, "block_tables": max_seqs * max_blocks,
                    "gpu_token_index": max_tokens, "gpu_token_rows": max_tokens, "logits_indices": max_seqs,
                    "sampling_rows": max_seqs, "temperatures": max_seqs}
        nbytes = sum(aligned(capacity[name] * np.dtype(dtype).itemsize) for name, dtype in UPLOADS)
        self.packed = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._packed_np = self.packed.numpy()
        self.sampled = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin)
        self.copied: torch.cuda.Event | None = torch.cuda.Event() if pin else None
        self.on_cuda = pin

    def pack(self, arrays: dict[str, np.ndarray]) -> tuple[int, dict[str, tuple[int, int, np.dtype]]]:
        """Write `arrays` (every name of `UPLOADS`, any integer/float dtype, cast to the listed one) into the
        packed buffer. Returns (bytes used, name -> (byte offset, element count, dtype))."""
        layout = {}
        offset = 0
        for name, dtype in UPLOADS:
            arr = arrays[name]
            count = arr.size
            np.copyto(self._packed_np[offset: offset + count * np.dtype(dtype).itemsize].view(dtype),
                      arr.reshape(-1), casting="same_kind")
            layout[name] = (offset, count, np.dtype(dtype))
            offset += aligned(count * np.dtype(dtype).itemsize)
        return offset, layout

    def tokens_to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying a step's sampled tokens `[s]` int64 into `sampled`; returns it and the event that
        marks their arrival (None on CPU, where the copy is done)."""
        out = self.sampled[: len(tokens)]
        if not self.on_cuda:
            out.copy_(tokens)
            return out, None
        out.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return out, event
