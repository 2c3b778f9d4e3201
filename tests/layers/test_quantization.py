"""FP8 linear layers on CPU: the torch path is the documented arithmetic, weights quantize as the releases'
do, scales split with their weights over tensor-parallel ranks, online quantization happens after loading,
and the loader refuses FP8 tensors it cannot read."""
import json
import shutil

import pytest
import torch

from fp8_checkpoint import block_quantize, channel_quantize
from nanovllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    ReplicatedLinear, RowParallelLinear)
from nanovllm.layers.quantization import building_with_quantization
from nanovllm.layers.quantization.fp8 import (FP8, Fp8BlockMethod, Fp8ChannelMethod, dequantize_weight,
                                              fp8_linear_torch, quantize_activations, quantize_weight)
from nanovllm.utils.loader import after_loading, load_model
from nanovllm.distributed.group import TensorParallelGroup, building_with

BLOCK = Fp8BlockMethod()
CHANNEL = Fp8ChannelMethod()


def reference_linear(x, q_w, s_w, scheme):
    """The module docstring's sum, element by element in float64: y[m, n] = sum_k (q_x s_x)(q_w s_w)."""
    m_rows, k_cols = x.shape
    y = torch.zeros(m_rows, q_w.shape[0], dtype=torch.float64)
    for m in range(m_rows):
        row = x[m].double()
        starts = range(0, k_cols, 128) if scheme == "block" else [0]
        q_x, s_x = torch.empty(k_cols, dtype=torch.float64), torch.empty(k_cols, dtype=torch.float64)
        for start in starts:
            end = start + 128 if scheme == "block" else k_cols
            s = max(row[start:end].abs().max().item(), 1e-12) / 448.0
            s = torch.tensor(s, dtype=torch.float32).double()      # a float32 scale
            q = (row[start:end].float() / s.float()).clamp(-448, 448).to(FP8).double()
            q_x[start:end], s_x[start:end] = q, s
        for n in range(q_w.shape[0]):
            w_scale = (s_w[n] if scheme == "channel"
                       else s_w[n // 128].repeat_interleave(128)[:k_cols]).double()
            y[m, n] = ((q_x * s_x) * (q_w[n].double() * w_scale)).sum()
    return y


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("shape", [(3, 40, 24), (4, 200, 300)])     # ragged groups and blocks too
def test_cpu_path_is_the_documented_arithmetic(scheme, shape):
    torch.manual_seed(0)
    m, n, k = shape
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)       # columns of very different sizes
    x[1, :5] = 0.0
    q_w, s_w = quantize_weight(torch.randn(n, k) * 0.05, scheme)
    y = fp8_linear_torch(x, q_w, s_w, scheme)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), reference_linear(x, q_w, s_w, scheme), rtol=1e-5, atol=1e-5)
    y16 = fp8_linear_torch(x.bfloat16(), q_w, s_w, scheme)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16, fp8_linear_torch(x.bfloat16().float(), q_w, s_w, scheme).bfloat16(), rtol=0, atol=0)


def test_weights_quantize_as_the_releases_do():
    torch.manual_seed(1)
    w = torch.randn(300, 260) * 0.02
    w[:5, :7] *= 100                # one block with an outlier
    q, s = quantize_weight(w, "block")
    q_ref, s_ref = block_quantize(w)
    assert s.shape == (3, 3) and torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q, s = quantize_weight(w, "channel")
    q_ref, s_ref = channel_quantize(w)
    assert s.shape == (300,) and torch.equal(s, s_ref[:, 0]) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # each row's (block's) largest value lands on 448 exactly, nothing saturates to inf or NaN
    assert q.float().abs().amax(1).eq(448).all() and torch.isfinite(q.float()).all()
    assert (dequantize_weight(q, s, "channel") - w).abs().max() <= w.abs().amax(1).max() / 16


def test_activation_values_round_to_nearest_even_and_saturate():
    # 1.0625 lies halfway between e4m3's 1.0 and 1.125 (3 mantissa bits): ties go to the even 1.0;
    # scale = amax / 448 = 1 for a row whose largest value is 448
    x = torch.tensor([[448.0, 1.0625, 1.1875, -0.0009765625 * 1.5, 0.0]])
    q, s = quantize_activations(x)
    assert s.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, -0.001953125, 0.0]]
    q, s = quantize_activations(torch.zeros(2, 256), 128)        # all zero: tiny scales, zeros, no NaN
    assert s.shape == (2, 2) and (s > 0).all() and q.float().eq(0).all()


class Unreduced(TensorParallelGroup):
    """A rank of a group without processes: row-parallel layers return their partial sums."""

    def all_reduce(self, x, op=None):
        return x


def build(layer_class, quantization, *args, rank=0, size=1, **kwargs):
    with building_with(Unreduced(rank, size)), building_with_quantization(quantization):
        return layer_class(*args, **kwargs)


def fill(layer, tensors: dict, shards: dict | None = None):
    """Load full checkpoint tensors {param name: tensor or [per-shard tensors]} through the weight loaders."""
    params = dict(layer.named_parameters())
    for name, tensor in tensors.items():
        if shards:
            for shard, part in zip(shards[name], tensor):
                params[name].weight_loader(params[name], part, shard)
        else:
            params[name].weight_loader(params[name], tensor)


def quantized_parts(parts, k, scheme):
    torch.manual_seed(2)
    return [quantize_weight(torch.randn(n, k) * 0.05, scheme) for n in parts]


@pytest.mark.parametrize("quantization", [BLOCK, CHANNEL], ids=["block", "channel"])
def test_merged_layers_split_their_scales_with_their_weights_over_two_ranks(quantization):
    """QKV (4 q heads, 2 kv heads of 128) and gate/up at TP=2: each rank's weight and scales are its rows of
    every part, stacked in order; its outputs are exactly its columns of the TP=1 layer's outputs (the
    activations quantize the same way: per token over all of K, or per group)."""
    scale_name = quantization.scale_name
    x = torch.randn(5, 256)
    for layer_class, args, parts, shard_ids in (
            (QKVParallelLinear, (256, 128, 4, 2), [512, 256, 256], ["q", "k", "v"]),
            (MergedColumnParallelLinear, (256, [512, 512]), [512, 512], [0, 1])):
        quantized = quantized_parts(parts, 256, quantization.scheme)
        tensors = {"weight": [q for q, _ in quantized], scale_name: [s for _, s in quantized]}
        shards = {"weight": shard_ids, scale_name: shard_ids}
        full = build(layer_class, quantization, *args)
        fill(full, tensors, shards)
        y = full(x)
        ranks = []
        for rank in range(2):
            layer = build(layer_class, quantization, *args, rank=rank, size=2)
            assert layer.weight.dtype == FP8 and getattr(layer, scale_name).dtype == torch.float32
            fill(layer, tensors, shards)
            ranks.append(layer)
            rows = torch.cat([torch.arange(off + rank * p // 2, off + (rank + 1) * p // 2)
                              for off, p in zip([0] + list(torch.tensor(parts).cumsum(0)[:-1].tolist()), parts)])
            assert torch.equal(layer.weight.view(torch.uint8), full.weight.view(torch.uint8)[rows])
            scales = getattr(full, scale_name)
            assert torch.equal(getattr(layer, scale_name), scales[rows] if quantization.scheme == "channel"
                               else scales[rows[::128] // 128])
            assert torch.equal(layer(x), y[:, rows])


@pytest.mark.parametrize("quantization", [BLOCK, CHANNEL], ids=["block", "channel"])
def test_row_parallel_splits_block_scales_by_columns_and_keeps_channel_scales_whole(quantization):
    [(q, s)] = quantized_parts([256], 512, quantization.scheme)
    bias = torch.randn(256)
    tensors = {"weight": q, quantization.scale_name: s, "bias": bias}
    full = build(RowParallelLinear, quantization, 512, 256, bias=True)
    fill(full, tensors)
    x = torch.randn(3, 512)
    partial = []
    for rank in range(2):
        layer = build(RowParallelLinear, quantization, 512, 256, bias=True, rank=rank, size=2)
        fill(layer, tensors)
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)[:, rank * 256:(rank + 1) * 256])
        scale = getattr(layer, quantization.scale_name)
        assert torch.equal(scale, s if quantization.scheme == "channel" else s[:, rank * 2:(rank + 1) * 2])
        partial.append(layer(x[:, rank * 256:(rank + 1) * 256]))     # partial sums (rank 0's with the bias)
    if quantization.scheme == "block":          # the same 1x128 groups on either side: only sums regroup
        torch.testing.assert_close(partial[0] + partial[1], full(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(full(x), fp8_linear_torch(x, q, s, quantization.scheme) + bias)   # bias after the GEMM


def test_block_shards_must_start_on_blocks():
    with pytest.raises(ValueError, match="output rows .*multiples of 128"):   # 2 heads of 64 per rank
        build(QKVParallelLinear, BLOCK, 256, 64, 2, 2, rank=0, size=2)
    with pytest.raises(ValueError, match="input columns .*multiples of 128"):
        build(RowParallelLinear, BLOCK, 384, 256, rank=0, size=2)
    with pytest.raises(ValueError, match="output rows"):                       # k starts mid-block
        build(QKVParallelLinear, BLOCK, 256, 64, 3, 1)
    build(QKVParallelLinear, BLOCK, 256, 128, 3, 1)                             # v may end mid-block at TP=1
    build(ColumnParallelLinear, BLOCK, 200, 200)                                # ragged alone: fine
    build(QKVParallelLinear, CHANNEL, 256, 64, 2, 2, rank=0, size=2)            # per channel: no constraint
    assert build(ReplicatedLinear, BLOCK, 64, 8).weight.dtype == torch.float32  # the MoE router stays precise


def test_online_quantization_happens_after_every_shard_is_loaded():
    online = Fp8ChannelMethod(online=True)
    layer = build(MergedColumnParallelLinear, online, 256, [128, 128])
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale")
    gate, up = torch.randn(128, 256), torch.randn(128, 256)
    fill(layer, {"weight": [gate, up]}, {"weight": [0, 1]})
    after_loading(layer)
    q, s = quantize_weight(torch.cat([gate, up]), "channel")
    assert layer.weight.dtype == FP8 and torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale, s)
    after_loading(layer)                         # a second call changes nothing
    assert torch.equal(layer.weight_scale, s)


def _copy_with(tiny_model, tmp_path, tensors_fn, quantization_config=None):
    from safetensors.torch import load_file, save_file
    other = tmp_path / "edited"
    shutil.copytree(tiny_model, other)
    tensors = tensors_fn(load_file(str(other / "model.safetensors")))
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((other / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (other / "config.json").write_text(json.dumps(config))
    return other


def test_the_loader_refuses_fp8_tensors_it_cannot_read(tiny_model, tmp_path):
    """FP8 tensors without a quantization_config would load as garbage numbers: refused by name; so are
    static activation scales, and a missing scale is named."""
    from fp8_checkpoint import to_block_fp8
    from nanovllm.models.qwen3 import Qwen3ForCausalLM
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_model)
    fp8 = to_block_fp8(tiny_model, tmp_path / "fp8")
    plain = Qwen3ForCausalLM(hf_config)
    with pytest.raises(ValueError, match="down_proj.weight is torch.float8_e4m3fn.*lacks the quantization_config"):
        load_model(plain, str(fp8))

    def scales_alone(tensors):
        return dict(tensors, **{"model.layers.0.mlp.up_proj.weight_scale": torch.ones(128, 1)})
    with pytest.raises(ValueError, match="up_proj.weight_scale\\) that the model does not expect"):
        load_model(plain, str(_copy_with(tiny_model, tmp_path / "a", scales_alone)))

    with building_with_quantization(BLOCK):
        quantized = Qwen3ForCausalLM(hf_config)
    load_model(quantized, str(fp8))
    from safetensors.torch import load_file
    stored = load_file(str(fp8 / "model.safetensors"))
    assert torch.equal(quantized.model.layers[1].mlp.down_proj.weight_scale_inv,
                       stored["model.layers.1.mlp.down_proj.weight_scale_inv"])

    def static(tensors):
        return dict(tensors, **{"model.layers.0.mlp.down_proj.input_scale": torch.ones(())})
    with pytest.raises(ValueError, match="static activation scales"):
        load_model(quantized, str(_copy_with(fp8, tmp_path / "b", static)))

    def no_scale(tensors):
        return {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.o_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match="lacks weights for: model.layers.0.self_attn.o_proj.weight_scale_inv"):
        load_model(quantized, str(_copy_with(fp8, tmp_path / "c", no_scale)))

    def bf16_weight(tensors):     # an unquantized projection where the config says FP8
        return dict(tensors, **{"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 512)})
    with pytest.raises(ValueError, match="dtype torch.float32 for an FP8 weight"):
        load_model(quantized, str(_copy_with(fp8, tmp_path / "d", bf16_weight)))


def fp8_layer(method, rows: int, cols: int) -> ColumnParallelLinear:
    with building_with_quantization(method):
        layer = ColumnParallelLinear(cols, rows)
    q_w, s_w = quantize_weight(torch.randn(rows, cols) * 0.05, method.scheme)
    layer.weight.data.copy_(q_w)
    getattr(layer, method.scale_name).data.copy_(s_w)
    return layer


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels: needs a CUDA GPU"))])
@pytest.mark.parametrize("method", [CHANNEL, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("num_rows", [1, 5, 40, 80])   # the GEMV (one row, on a GPU), skinny GEMMs, a tiled one
def test_norm_and_gate_write_an_fp8_layers_input_as_the_layer_would_quantize_it(num_rows, method, device):
    """A module whose output one FP8 layer alone reads (RMSNorm before q/k/v or gate/up, SiLU-and-mul before
    down) hands it the e4m3 values and scales the layer would have computed (on a GPU in the same kernel as
    the norm or the gate): the layer's output is unchanged, bit for bit."""
    from nanovllm.layers.activation import SiluAndMul
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.quantization.base import QuantizedActivations
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = fp8_layer(method, 64, 256).to(device)
    norm, gate = RMSNorm(256).to(device, dtype), SiluAndMul()
    norm.weight.data = (1 + 0.1 * torch.randn(256)).to(device, dtype)
    x, residual, gate_up = (t.to(device, dtype) for t in (torch.randn(num_rows, 256), torch.randn(num_rows, 256),
                                                          2 * torch.randn(num_rows, 512)))
    plain_normed, plain_summed = norm(x, residual)
    plain_first = norm(x)
    plain_gated = gate(gate_up)
    norm.output_quantization = gate.output_quantization = layer.input_quantization()
    normed, summed = norm(x, residual)
    first, gated = norm(x), gate(gate_up)
    # a lone row reaches a per-channel layer on a GPU in the model's dtype (its GEMV reads it so)
    plain_row = device == "cuda" and num_rows == 1 and method is CHANNEL
    assert all(isinstance(out, QuantizedActivations) != plain_row for out in (normed, first, gated))
    assert torch.equal(summed, plain_summed)
    for quantized, plain in ((normed, plain_normed), (first, plain_first), (gated, plain_gated)):
        assert torch.equal(layer(quantized), layer(plain))


@pytest.mark.parametrize("quantized_input", [False, True], ids=["plain-input", "quantized-input"])
def test_a_layer_feeding_a_residual_norm_may_leave_its_output_scales_to_it(quantized_input, monkeypatch):
    """Where the model says so (defer_output_scales) and fp8_gemm finds the unscaled GEMM the faster (forced
    here, the GEMM emulated on CPU), an FP8 layer returns its product without scales (ScaledOutput), whose value
    is the layer's output; the RMSNorm after it applies the scales and gives what it gives the plain output."""
    from nanovllm.kernels import fp8_gemm
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.quantization.base import ScaledOutput
    torch.manual_seed(0)
    layer = fp8_layer(CHANNEL, 64, 256)
    x, residual = torch.randn(80, 256), torch.randn(80, 64)
    if quantized_input:         # as SiLU-and-mul hands it to down_proj
        x = layer.input_quantization().quantize(x)
    norm = RMSNorm(64)
    norm.weight.data = 1 + 0.1 * torch.randn(64)
    plain = layer(x)
    layer.defer_output_scales = "norm"
    assert torch.equal(layer(x), plain)             # the CPU path applies its scales: nothing is faster there
    monkeypatch.setattr(fp8_gemm, "defers_output_scales", lambda *shape: True)
    monkeypatch.setattr(fp8_gemm, "unscaled_matmul", lambda q, w, dtype: (q.float() @ w.float().t()).to(dtype))
    deferred = layer(x)
    assert isinstance(deferred, ScaledOutput) and deferred.shape == plain.shape
    torch.testing.assert_close(deferred.materialize(), plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    for got, expected in zip(norm(deferred, residual), norm(plain, residual), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    layer.defer_output_scales = None
    assert torch.equal(layer(x), plain)


def test_gate_up_may_leave_its_output_scales_to_silu_and_mul(monkeypatch):
    """gate_up_proj's product without scales (forced, the GEMM emulated on CPU) is its output once
    materialized, and SiLU-and-mul gives from it what it gives from the plain output (written quantized for
    down_proj, as in the model)."""
    from nanovllm.kernels import fp8_gemm
    from nanovllm.layers.activation import SiluAndMul
    from nanovllm.layers.quantization.base import ScaledOutput
    torch.manual_seed(0)
    layer = fp8_layer(CHANNEL, 2 * 96, 64)
    x = layer.input_quantization().quantize(torch.randn(80, 64))     # as the residual norm hands it over
    gate = SiluAndMul()
    gate.output_quantization = fp8_layer(CHANNEL, 32, 96).input_quantization()
    plain = layer(x)
    layer.defer_output_scales = "silu"
    monkeypatch.setattr(fp8_gemm, "defers_output_scales", lambda *shape: True)
    monkeypatch.setattr(fp8_gemm, "unscaled_matmul", lambda q, w, dtype: (q.float() @ w.float().t()).to(dtype))
    deferred = layer(x)
    assert isinstance(deferred, ScaledOutput) and deferred.shape == plain.shape
    torch.testing.assert_close(deferred.materialize(), plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    got, expected = gate(deferred), gate(plain)
    torch.testing.assert_close(got.scales, expected.scales, rtol=1e-5, atol=0)
    assert (got.values.float() != expected.values.float()).float().mean() < 0.01     # an e4m3 rounding flipped at most


def test_a_reader_takes_the_raw_product_and_its_scales_only_where_its_kernel_applies_them():
    """reader_input, shared by RMSNorm and SiLU-and-mul: a ScaledOutput's raw values and (row, column) scales
    where the reader's kernel applies them, its materialized value elsewhere; a plain tensor as it is; the
    reader's output quantization dropped where it does not apply to the input."""
    from nanovllm.layers.quantization.base import InputQuantization, ScaledOutput, reader_input
    raw, rows, cols = torch.randn(4, 6), torch.rand(4) + 0.5, torch.rand(6) + 0.5
    scaled = ScaledOutput(raw, rows, cols)
    x, scales, quantization = reader_input(scaled, lambda t: t is raw, None)
    assert x is raw and scales[0] is rows and scales[1] is cols and quantization is None
    x, scales, _ = reader_input(scaled, lambda t: False, None)
    assert scales is None and torch.equal(x, scaled.materialize())
    plain = torch.randn(4, 6)

    class Never(InputQuantization):
        def applies(self, x):
            return False
    always, never = InputQuantization(), Never()
    x, scales, quantization = reader_input(plain, lambda t: True, always)
    assert x is plain and scales is None and quantization is always
    assert reader_input(plain, lambda t: True, never)[2] is None


def test_models_wire_fp8_inputs_only_where_one_projection_reads_them():
    """FP8 projections' producers write their input form; in the model's dtype nothing changes."""
    from transformers import Qwen3Config
    from nanovllm.models.qwen3 import Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    with building_with(TensorParallelGroup()):
        plain = Qwen3ForCausalLM(config)
        with building_with_quantization(CHANNEL):
            fp8 = Qwen3ForCausalLM(config)
    for model, wired in ((plain, False), (fp8, True)):
        layer = model.model.layers[0]
        producers = (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn)
        assert all((p.output_quantization is not None) == wired for p in producers)
        assert model.model.norm.output_quantization is None                 # the LM head stays in bf16
        assert layer.self_attn.q_norm.output_quantization is None
        # on one rank, o_proj and down_proj feed residual norms: they may leave their scales to them; gate_up_proj
        # to SiLU-and-mul
        assert layer.self_attn.o_proj.defer_output_scales == layer.mlp.down_proj.defer_output_scales == "norm"
        assert layer.mlp.gate_up_proj.defer_output_scales == "silu"
        assert layer.self_attn.qkv_proj.defer_output_scales is None
    # over two ranks each holds a partial sum, all-reduced in the model's dtype: every scale applied first
    config.num_key_value_heads = 2
    with building_with(Unreduced(0, 2)), building_with_quantization(CHANNEL):
        layer = Qwen3ForCausalLM(config).model.layers[0]
    assert layer.self_attn.o_proj.defer_output_scales is None and layer.mlp.down_proj.defer_output_scales is None
    assert layer.mlp.gate_up_proj.defer_output_scales == "silu"     # each rank's gate and up columns are whole
