"""Linear layers that shard their weight across the tensor-parallel group.

Column-parallel layers split the output features (no communication); row-parallel layers split the
input features and all-reduce their partial sums. Each parameter's `weight_loader` copies its own
shard out of a full checkpoint tensor.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.parallel import current_group


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None):
        super().__init__()
        self.tp = current_group()
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _copy_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, offset: int, size: int,
                    shard_index: int) -> None:
        """Copy this rank's slice (shard_index of loaded_weight along tp_dim) into param[offset:offset+size]."""
        target = param.data.narrow(self.tp_dim, offset, size)
        source = loaded_weight.narrow(self.tp_dim, shard_index * size, size)
        if target.shape != source.shape:
            raise ValueError(f"checkpoint shard {tuple(source.shape)} does not fit {tuple(target.shape)}")
        target.copy_(source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = current_group()
        super().__init__(input_size, _divide(output_size, tp.size), bias, tp_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.data.size(self.tp_dim)
        self._copy_shard(param, loaded_weight, 0, size, self.tp.rank)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): shard i comes from checkpoint tensor i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int) -> None:
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp.size
        size = self.output_sizes[loaded_shard_id] // self.tp.size
        self._copy_shard(param, loaded_weight, offset, size, self.tp.rank)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp = current_group()
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp.size)
        self.num_kv_heads = _divide(total_num_kv_heads, tp.size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[loaded_shard_id]
        self._copy_shard(param, loaded_weight, offset, size, self.tp.rank)


class RowParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = current_group()
        super().__init__(_divide(input_size, tp.size), output_size, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.data.dim() == 1:               # the bias is added once, on rank 0's partial sum
            param.data.copy_(loaded_weight)
            return
        size = param.data.size(self.tp_dim)
        self._copy_shard(param, loaded_weight, 0, size, self.tp.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y)
