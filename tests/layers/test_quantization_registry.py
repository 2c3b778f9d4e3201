"""Quantization methods come from a registry by name: a scheme registered from outside the package (here a toy
that keeps the model's dtype, written against the method interface alone) runs a whole engine with
LLM(quantization=its name), and gives the unquantized model's greedy tokens; unknown names are refused,
listing the registered ones."""
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.layers.quantization import (QUANTIZATION_METHODS, QuantizationMethod, register_quantization,
                                          warmup_token_counts)

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

TOY = "passthrough"


class Passthrough(QuantizationMethod):
    """The weight as the checkpoint stores it, in the model's dtype: loaded, marked finished after loading
    (the linear layers run only once it is), multiplied with F.linear; MoE layers unsupported (the default)."""
    name = TOY
    WARMUP = (3, 17)

    def create_weights(self, layer, input_size, output_parts, tp_size, input_split):
        layer.weight = nn.Parameter(torch.empty(sum(output_parts), input_size), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def process_weights_after_loading(self, layer):
        layer.passthrough_loaded = True

    def apply(self, layer, x, bias):
        assert getattr(layer, "passthrough_loaded", False), "ran before process_weights_after_loading"
        return F.linear(x, layer.weight, bias)

    def warmup_token_counts(self, layer):
        return self.WARMUP


@pytest.fixture
def toy():
    register_quantization(Passthrough)
    yield Passthrough
    del QUANTIZATION_METHODS[TOY]


PROMPTS = [[1, 2, 3, 4, 5], [100, 7, 300], list(range(40, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy_tokens(llm):
    return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_method_registered_outside_the_package_runs_the_engine(tiny_model, toy):
    with LLM(str(tiny_model), device="cpu") as llm:
        plain = greedy_tokens(llm)
    with LLM(str(tiny_model), device="cpu", quantization=TOY) as llm:
        assert greedy_tokens(llm) == plain
        assert llm.config.quantization == TOY and isinstance(llm.config.quant_method, Passthrough)
        model = llm.model_runner.model
        proj = model.model.layers[0].self_attn.qkv_proj
        assert isinstance(proj.quant_method, Passthrough) and proj.passthrough_loaded
        assert set(Passthrough.WARMUP) <= set(warmup_token_counts(model))


def test_unknown_names_are_refused_listing_the_registered_ones(tiny_model, toy):
    with pytest.raises(ValueError, match="quantization must be None or one of 'fp8', 'passthrough', got 'bogus'"):
        Config(str(tiny_model), quantization="bogus")
    with pytest.raises(ValueError, match="is already registered"):
        register_quantization(type("Other", (QuantizationMethod,), {"name": TOY}))


def test_a_method_without_moe_support_refuses_moe_models(make_checkpoint, toy):
    moe = make_checkpoint(architecture="Qwen3MoeForCausalLM", weights=False)
    with pytest.raises(ValueError, match="quantization='passthrough' does not support mixture-of-experts"):
        LLM(str(moe), device="cpu", load_format="dummy", quantization=TOY)


def test_a_quantized_checkpoint_is_read_by_its_own_method_only(tiny_model, tmp_path, toy):
    other = tmp_path / "fp8"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'fp8', which quantization='fp8' reads; quantization="
                                         "'passthrough' cannot apply"):
        Config(str(other), quantization=TOY, load_format="dummy")
    assert Config(str(other), load_format="dummy").quantization == "fp8"
