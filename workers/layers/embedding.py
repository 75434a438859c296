"""Token embedding and LM head split by vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common import envs
from workers.layers.linear import linear
from workers.parallel import all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r*P, (r+1)*P) with P = ceil(vocab_size / N) (the last rank's
    tail is zero padding). Each rank embeds the ids it owns and the partial rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids `[num_tokens]` int64 -> `[num_tokens, hidden_size]`."""
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        return all_reduce(y * mask.unsqueeze(1).to(y.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden `[n, hidden_size]` -> this rank's logits `[n, vocab_end - vocab_start]`: columns
    vocab_start.. of the vocabulary (all of it at TP=1). The logits are never gathered: the
    sampler picks each rank's best candidate and the ranks exchange only those (workers/sampler.py). At a small
    batch the product runs through our GEMV kernel (`workers/layers/linear.py` `linear`)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.gemv_max_batch = envs.gemv_max_batch()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return linear(hidden, self.weight[: self.vocab_end - self.vocab_start], None, self.gemv_max_batch)
