"""Linear layers that know how to load (and tensor-parallel shard) their own weights.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)``: the model loader calls it
with the checkpoint tensor (a tensor or a lazy slice: only ``narrow`` and ``full_tensor`` are used on
it) and the layer copies in the slice that belongs to this rank. Fused
layers (q/k/v, gate/up) take their parts by ``shard_id``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_engine.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from kvfleet_engine.layers.prepack import linear
from kvfleet_engine.models.loader import full_tensor


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(out_features)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # oneDNN's blocked copy of ``weight`` on CPU (see layers/prepack.py); None = plain F.linear.
        self.packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(full_tensor(loaded))


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication (the next row-parallel layer reduces)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, get_tp_size(), "output features"), bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks, KV heads replicated if fewer than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor-parallel size over KV heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param, loaded, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results all-reduced (bias added once, after)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(_divide(in_features, get_tp_size(), "input features"), out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not split
            param.data.copy_(full_tensor(loaded))
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return tp_all_reduce(linear(x, self.weight, bias, self.packed_weight))
