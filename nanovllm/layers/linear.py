"""Linear layers that shard their weight across the tensor-parallel group.

Column-parallel layers split the output features (no communication); row-parallel layers split the
input features and all-reduce their partial sums. Each parameter's `weight_loader` copies its own
shard out of a full checkpoint tensor.

Every layer holds, loads and runs its weight through the quantization method it was built under
(layers/quantization: `self.quant_method`, the model's dtype by default); a quantized layer's extra parameters
(FP8 scales, ...) are split over the ranks with the weights. ReplicatedLinear (the MoE router) stays in the
model's dtype.
"""
import torch
from torch import nn

from nanovllm.kernels import skinny_gemm
from nanovllm.layers.quantization import UNQUANTIZED, current_quant_method
from nanovllm.distributed.group import current_group


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    quantizable = True      # False: never quantized (ReplicatedLinear: the MoE router, kept precise as in vLLM)
    # set by the model where the module reading the output can apply a quantized GEMM's scales in its own pass:
    # "norm", the RMSNorm that adds the residual after o_proj and down_proj on one rank; "silu", SiLU-and-mul after
    # gate_up_proj. A quantized layer may then return a ScaledOutput (layers/quantization)
    defer_output_scales: str | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None,
                 output_parts: list[int] | None = None):
        """input_size, output_size: this rank's; output_parts: this rank's share of each merged output."""
        super().__init__()
        self.tp = current_group()
        self.tp_dim = tp_dim
        self.input_size, self.output_size = input_size, output_size
        self.quant_method = current_quant_method() if self.quantizable else UNQUANTIZED
        self.quant_method.create_weights(self, input_size, output_parts or [output_size], self.tp.size,
                                         input_split=tp_dim == 1)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _copy_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, offset: int, size: int,
                    shard_index: int) -> None:
        """Copy this rank's slice (shard_index of loaded_weight along tp_dim) into param[offset:offset+size].
        offset and size count weight rows (columns for row-parallel layers); a parameter with a `shard_unit`
        (FP8 block scales: 128) has entries that each cover that many (shards start on them: its quantization
        method checks)."""
        unit = getattr(param, "shard_unit", 1)
        offset, size = offset // unit, -(-size // unit)
        target = param.data.narrow(self.tp_dim, offset, size)
        source = loaded_weight.narrow(self.tp_dim, shard_index * size, size)
        if target.shape != source.shape:
            raise ValueError(f"checkpoint shard {tuple(source.shape)} does not fit {tuple(target.shape)}")
        if target.dtype == torch.float8_e4m3fn and source.dtype != target.dtype:
            raise ValueError(f"checkpoint tensor of dtype {source.dtype} for an FP8 weight: its quantization_config "
                             f"says the layer is quantized")
        target.copy_(source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def input_quantization(self):
        """How the module that alone feeds this layer may write its input (None: in the model's dtype):
        the model sets it as that module's `output_quantization`."""
        return self.quant_method.input_quantization(self)

    def process_weights_after_loading(self) -> None:
        """Called by the loader once every checkpoint tensor is in: online quantization happens here."""
        self.quant_method.process_weights_after_loading(self)

    def warmup_token_counts(self) -> tuple[int, ...]:
        """Token counts whose prefill compiles each kernel variant this layer can take."""
        return self.quant_method.warmup_token_counts(self)


class ReplicatedLinear(LinearBase):
    quantizable = False

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False, output_parts: list[int] | None = None):
        tp = current_group()
        super().__init__(input_size, _divide(output_size, tp.size), bias, tp_dim=0,
                         output_parts=output_parts and [_divide(part, tp.size) for part in output_parts])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self._copy_shard(param, loaded_weight, 0, self.output_size, self.tp.rank)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): shard i comes from checkpoint tensor i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, output_parts=output_sizes)

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
        kv = total_num_kv_heads * head_size
        super().__init__(hidden_size, output_size, bias, output_parts=[total_num_heads * head_size, kv, kv])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[loaded_shard_id]
        self._copy_shard(param, loaded_weight, offset, size, self.tp.rank)


class RowParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = current_group()
        super().__init__(_divide(input_size, tp.size), output_size, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.data.dim() == 1:   # the bias (added once, on rank 0's partial sum) or per-channel FP8 scales
            if param.shape != loaded_weight.shape:
                raise ValueError(f"checkpoint tensor {tuple(loaded_weight.shape)} does not fit {tuple(param.shape)}")
            param.data.copy_(loaded_weight)
            return
        self._copy_shard(param, loaded_weight, 0, self.input_size, self.tp.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(self.quant_method.apply(self, x, bias))


def dense_warmup_token_counts() -> tuple[int, ...]:
    """Row counts that reach each GEMM variant of the model's dtype (the GEMV's one row, the LM head's skinny
    buckets): the engine's warm-up runs each once."""
    return tuple(sorted({1, *skinny_gemm.config_token_counts()}))    # 1: the GEMV
