"""Linear layers split across tensor-parallel ranks (the Megatron-LM scheme, Shoeybi et al. 2019).

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's part of a checkpoint tensor into it, so the loader never needs to know the layout.
Weights are `[out_features, in_features]` as in `torch.nn.Linear`. At a small batch (decode) the
matmul runs through our GEMV kernel (`gpu_kernels/gemv.py`, see `linear`), otherwise through cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common import envs
from workers.deterministic import deterministic
from workers.layers.fused import fused_kernels_enabled
from workers.parallel import all_reduce, tp_rank, tp_size

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv_max_batch: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x `[T, in]`, weight `[out, in]`, bias `[out]` or None -> `[T, out]`.

    Runs our small-batch GEMV kernel (`gpu_kernels.gemv.gemv`, which reads the weight at memory bandwidth where
    cuBLAS does not) when the fused kernels are on for x (`fused_kernels_enabled`), x is 2-D with 1 to
    `gemv_max_batch` rows (`DELTASERVE_GEMV_MAX_BATCH`; 0 never), and weight is a contiguous bf16/fp16
    matrix of x's dtype; F.linear otherwise. In deterministic mode (workers/deterministic.py) always the
    batch-invariant matmul.
    """
    if deterministic():
        from gpu_kernels.batch_invariant import matmul_batch_invariant

        return matmul_batch_invariant(x, weight, bias)
    if (x.dim() == 2 and 0 < x.shape[0] <= gemv_max_batch and fused_kernels_enabled(x)
            and weight.dtype in _GEMV_DTYPES and x.dtype == weight.dtype and weight.is_contiguous()
            and x.stride(1) == 1 and (bias is None or bias.is_contiguous())):
        from gpu_kernels.gemv import gemv  # Triton is imported only where it runs

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


class LinearBase(nn.Module):
    """A linear layer whose weight is `[out_local, in_local]` on this rank."""

    def __init__(self, in_local: int, out_local: int, bias: bool) -> None:
        super().__init__()
        self.gemv_max_batch = envs.gemv_max_batch()
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemv_max_batch)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r computes rows [r*out/N, (r+1)*out/N) of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, tp_size(), "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers fused into one matmul (gate_proj and up_proj of an MLP).

    Checkpoint tensor `shard_id = i` fills this rank's slice of output block i.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        n = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // n
        size = self.output_sizes[shard_id] // n
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by attention heads.

    Rank r holds query heads [r*H/N, (r+1)*H/N). With fewer KV heads than ranks, each KV head
    is replicated on N/H_kv consecutive ranks (rank r holds KV head r // (N/H_kv)).
    Checkpoint tensors use `shard_id` "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        n = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, n, "num_attention_heads")
        if num_kv_heads >= n:
            self.num_kv_heads = _divide(num_kv_heads, n, "num_key_value_heads")
            self.kv_head_start = tp_rank() * self.num_kv_heads
        else:
            _divide(n, num_kv_heads, "tensor-parallel size over num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank() // (n // num_kv_heads)
        out_total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * n
        super().__init__(hidden_size, out_total, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, tp_rank() * q_size
        elif shard_id == "k":
            offset, size, start = q_size, kv_size, self.kv_head_start * d
        elif shard_id == "v":
            offset, size, start = q_size + kv_size, kv_size, self.kv_head_start * d
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    The bias is added once, after the sum. With `reduce_results=False` the layer returns this
    rank's partial output (bias added on rank 0 only) and the caller sums it, so the all-reduce
    can be fused with what follows (`RMSNorm.reduce_add`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__(_divide(in_features, tp_size(), "input features"), out_features, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: not split
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(linear(x, self.weight, None, self.gemv_max_batch))

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """What `forward` does after its product: the all-reduce and the bias, on `y` = x @ weight.T computed
        elsewhere (a kernel that fused the layer before into it)."""
        if tp_size() > 1 and self.reduce_results:
            y = all_reduce(y)
        if self.bias is not None and (self.reduce_results or tp_rank() == 0):
            y = y + self.bias
        return y
