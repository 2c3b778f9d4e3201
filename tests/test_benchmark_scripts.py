"""The scripts in benchmarks/ (and bench.py, and the tests' helpers) import what nanovllm still has: each
`from nanovllm.x import a, b` names something nanovllm.x defines, so a function moved to another module fails
here, on the CPU, and not first on a GPU box (bench_moe.py imported `route` from kernels/fused_moe.py after it
moved to kernels/moe_routing.py)."""
import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("benchmarks/*.py")) + [ROOT / "bench.py"] + sorted(ROOT.glob("tests/*.py"))

pytestmark = pytest.mark.cpu_only


def nanovllm_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every `from nanovllm... import name` in the file; (module, None) for `import nanovllm...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nanovllm":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "nanovllm"]
    return found


def test_the_scan_sees_a_moved_name(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("from nanovllm.kernels.fused_moe import fused_moe, route\nimport nanovllm.kernels.moe_routing\n")
    assert nanovllm_imports(script) == [("nanovllm.kernels.fused_moe", "fused_moe"),
                                        ("nanovllm.kernels.fused_moe", "route"), ("nanovllm.kernels.moe_routing", None)]
    assert not hasattr(importlib.import_module("nanovllm.kernels.fused_moe"), "route")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_nanovllm_name_a_script_imports_exists(script):
    missing = []
    for module_name, name in nanovllm_imports(script):
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name) and importlib.util.find_spec(f"{module_name}.{name}") is None:
            missing.append(f"{module_name}.{name}")
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
