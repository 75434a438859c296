"""Arrival counters for kernels whose last-finishing program combines the partial results of a split ("last block").

A kernel split over K (`gpu_kernels/gemv.py`) or over a sequence's KV (`gpu_kernels/paged_decode.py`) writes one
partial result per split; each program then adds one to its output tile's counter (an atomic add with acquire-release
semantics), and the program that arrives last combines all partials in a fixed order, writes the output and sets the
counter back to 0. One launch instead of two, and the bits never depend on which split finished when (the CUDA
samples' threadFenceReduction pattern, with only the counter atomic).

One persistent int32 workspace per device, zeroed once when first allocated and left zeroed by every launch. A
caller that captures CUDA graphs must make one eager call of each splitting kernel on the device before the first
capture (the model runner's warm-up forward of each batch size does): allocating inside a capture raises. Kernels
using the counters must be ordered on one stream (two streams running concurrently would share them); a CUDA graph
replays them in order like any other launches, and a kernel launched early by PDL touches them only after waiting
for the kernel before it.
"""

from __future__ import annotations

import torch

# Workspaces replaced by a larger one stay alive: CUDA graphs captured with them still point at them, and each is left
# all zeros by every launch.
_counters: dict[torch.device, torch.Tensor] = {}
_retired_counters: list[torch.Tensor] = []


def split_counters(device: torch.device, tiles: int, kernel: str, reserve: int = 0) -> torch.Tensor:
    """The device's arrival counters, int32 zeros, at least `tiles` of them; `kernel` names the caller in the error.

    `reserve`: how many a first allocation makes at least, the most output tiles the caller's heuristic ever splits,
    so that a later, larger grid (say, captured in a CUDA graph) needs no new allocation.

    Raises:
        RuntimeError: they must be allocated (first splitting call on the device, or a grid larger than any before)
            while the current stream is capturing a CUDA graph.
    """
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the split counters on {device} must be allocated before a CUDA graph capture: make "
                               f"one eager split {kernel} call on this device first ({tiles} output tiles)")
        if counters is not None:
            _retired_counters.append(counters)
        size = max(tiles, reserve)
        counters = _counters[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters
