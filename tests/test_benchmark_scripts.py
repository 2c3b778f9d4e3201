"""The scripts in benchmarks/ (and bench.py, and the tests' helpers) import what nanovllm still has: each
`from nanovllm.x import a, b` names something nanovllm.x defines, so a function moved to another module fails
here, on the CPU, and not first on a GPU box (bench_moe.py imported `route` from kernels/fused_moe.py after it
moved to kernels/moe_routing.py)."""
import importlib
import importlib.util
from pathlib import Path

import pytest
from source_names import missing_names, nanovllm_imports

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("benchmarks/*.py")) + [ROOT / "bench.py"] + sorted(ROOT.glob("tests/*.py"))

pytestmark = pytest.mark.cpu_only


def test_the_scan_sees_a_moved_name(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("from nanovllm.kernels.fused_moe import fused_moe, route\nimport nanovllm.kernels.moe_routing\n")
    assert nanovllm_imports(script.read_text()) == [
        ("nanovllm.kernels.fused_moe", "fused_moe"), ("nanovllm.kernels.fused_moe", "route"),
        ("nanovllm.kernels.moe_routing", None)]
    assert not hasattr(importlib.import_module("nanovllm.kernels.fused_moe"), "route")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_nanovllm_name_a_script_imports_exists(script):
    missing = missing_names(script.read_text())
    assert not missing, f"{script.name} imports what nanovllm no longer has: {missing}"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or __import__("torch").cuda.is_available(),
                    reason="the GPU box runs the benchmark itself")
def test_the_shared_prefix_benchmark_dry_runs_on_the_cpu():
    """benchmarks/bench_shared_prefix.py on a CPU: one small layout in the interpreter, the grouped output
    checked against every row reading its own keys, the saved fraction reported."""
    spec = importlib.util.spec_from_file_location("bench_shared_prefix", ROOT / "benchmarks/bench_shared_prefix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (result,) = module.main([])
    assert result["layout"] == "dry" and result["items"] == 2
    assert result["saved_fraction"] == round((2 * 256 + 512) / (300 + 290 + 280 + 600 + 610), 3)


def test_projection_shapes_are_the_engines_own_weight_shapes():
    """The GEMM benchmarks take a layer's (N, K) from benchmarks.random_checkpoint.projection_shapes: they are
    the shapes of the weights the engine's Qwen3 layer holds (heads x head_dim unlike hidden, grouped kv heads)."""
    from transformers import Qwen3Config

    from benchmarks.random_checkpoint import projection_shapes
    from nanovllm.distributed.group import TensorParallelGroup, building_with
    from nanovllm.models.qwen3 import Qwen3ForCausalLM
    shape = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    with building_with(TensorParallelGroup()):
        layer = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, num_hidden_layers=1, **shape)).model.layers[0]
    weights = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
               "down": layer.mlp.down_proj}
    assert projection_shapes(shape) == {name: tuple(module.weight.shape) for name, module in weights.items()}
