"""Token sampling: greedy rows by argmax, the others by the Gumbel-max trick.

Sampling from softmax(logits / T) by the Gumbel-max trick (Gumbel 1954; see Maddison, Tarlow &
Minka, "A* Sampling", 2014) in its exponential-race form: with E_i ~ Exp(1) independent,
argmax_i p_i / E_i is distributed as p. It needs one random draw per vocabulary entry and no
sort or cumulative sum, and runs batched on the device.

A request with a seed draws its noise from a generator seeded by (seed, position of the token
being sampled), so its samples do not depend on which other requests share the batch, nor on
preemption and recomputation.

On CUDA the whole batch is sampled by one fused Triton kernel (`kernels/sampling.py`, Gumbel-max
with in-kernel Philox noise: the logits are read once); on CPU by the torch code below. The two
draw different noise, so seeded samples are reproducible per device type.
"""

from __future__ import annotations

import numpy as np
import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 64 bits


def seeded_generator_seed(seed: int, position: int) -> int:
    """The generator seed used for a seeded request's token at `position` (0..2**63-1)."""
    return ((seed * _SEED_MIX) ^ position) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._fused = device.type == "cuda"
        self._seeds = np.random.default_rng(seed)  # per-row Philox seeds of the fused kernel

    @torch.no_grad()
    def __call__(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        all_greedy: bool,
        seeded_rows: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """Sample one token per row.

        logits `[n, vocab]` (any float dtype, computed in float32); temperatures `[n]` float32
        on the same device (0 = greedy); `all_greedy` skips the random path when every row is
        greedy; `seeded_rows` lists (row, seed, position) for requests with a seed.
        Returns token ids `[n]` int64.
        """
        if all_greedy:
            return logits.argmax(dim=-1)
        if self._fused:
            from kernels.sampling import sample_tokens

            seeds = self._seeds.integers(0, 2**62, size=logits.shape[0], dtype=np.int64)
            for row, seed, position in seeded_rows or ():
                seeds[row] = seeded_generator_seed(seed, position)
            return sample_tokens(logits, temperatures, torch.from_numpy(seeds).to(self.device, non_blocking=True))
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
        # Shift each row's maximum to 0 first: logits / T then cannot overflow to inf (NaN after softmax).
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(shifted / safe_t.unsqueeze(1), dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seed, position in seeded_rows or ():
            self._generator.manual_seed(seeded_generator_seed(seed, position))
            noise[row].exponential_(generator=self._generator)
        # A zero draw would divide by zero; clamping keeps impossible tokens (p = 0) at 0.
        sampled = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy)
