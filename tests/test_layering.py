"""The house's floors: every module of nanovllm/ lives on one floor, and imports only point down.

Top to bottom (docs/architecture.md says what each room on a floor holds):

    entrypoints      nanovllm/entrypoints/, serve.py: the faces beyond LLM, reaching the engine only
                     through AsyncLLM: the OpenAI server, `nanovllm serve`, `nanovllm chat`, the
                     `nanovllm` command
    batch            batch.py: batch inference on Ray Data, through the public LLM
    package          __init__.py: the public names (LLM, AsyncLLM, EngineDeadError, SamplingParams),
                     each imported on first use
    async_llm        async_llm.py: AsyncLLM, the engine in its own process driven from asyncio
    llm              llm.py: LLM, the offline face of LLMEngine
    engine           nanovllm/engine/: LLMEngine and its step loop, Scheduler and BlockManager, ModelRunner
                     and its rooms (warm-up, KV cache, step and sampling inputs, CUDA graphs), the
                     engine process and its typed messages, output processing and detokenizing
    config           config.py: Config, every setting checked once
    models           nanovllm/models/: the model classes and the registry by architecture
    layers           nanovllm/layers/: the torch modules the models are built of (linear, attention,
                     rotary + KV store, MoE, sampler, ...) and the quantization methods
    distributed      nanovllm/distributed/: the tensor-parallel group and its collectives, peer memory,
                     the worker processes and their channels (never the engine: the worker's runner is
                     handed in)
    kernels          nanovllm/kernels/: Triton kernels and their plain-PyTorch references
    utils            nanovllm/utils/: per-step attention context, host-to-device copies, the weight loader,
                     command-line options, histograms, the GGUF default model
    sampling_params  sampling_params.py: SamplingParams, imported by every floor above

A module may import modules of its own floor and of the floors below it, never one above: at module
level, inside a function (a lazy import), under TYPE_CHECKING, or by name through importlib (a string
that names a nanovllm submodule, as the lazy-import tables of __init__.py, models/__init__.py and
entrypoints/cli.py hold). Hence the floors' import graph has no cycle. No file is over MAX_LINES
lines, except the LONG_FILES listed below, each with its reason.
"""
import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanovllm"
MAX_LINES = 450


@dataclass(frozen=True)
class Floor:
    name: str
    paths: tuple[str, ...]      # files, or folders ending in "/", relative to the repository root


FLOORS = [      # top to bottom
    Floor("entrypoints", ("nanovllm/entrypoints/", "nanovllm/serve.py")),
    Floor("batch", ("nanovllm/batch.py",)),
    Floor("package", ("nanovllm/__init__.py",)),
    Floor("async_llm", ("nanovllm/async_llm.py",)),
    Floor("llm", ("nanovllm/llm.py",)),
    Floor("engine", ("nanovllm/engine/",)),
    Floor("config", ("nanovllm/config.py",)),
    Floor("models", ("nanovllm/models/",)),
    Floor("layers", ("nanovllm/layers/",)),
    Floor("distributed", ("nanovllm/distributed/",)),
    Floor("kernels", ("nanovllm/kernels/",)),
    Floor("utils", ("nanovllm/utils/",)),
    Floor("sampling_params", ("nanovllm/sampling_params.py",)),
]

# path -> (the most lines it may have, why it is not split)
LONG_FILES = {
    "nanovllm/kernels/fused_moe.py": (
        500, "one launch sequence (route, count, place, gate-up GEMM, down GEMM, sum) that its docstring walks "
             "through as a whole; the two GEMM kernels share its private @triton.jit helpers and MoeConfig's tiles"),
    "nanovllm/kernels/sampling.py": (
        500, "the sampling passes (sample, candidates, filter_and_draw, exact_thresholds) share private "
             "@triton.jit helpers (order keys, Gumbel noise, kept-token loads) and one docstring that explains "
             "them as one design"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
# namespace packages (folders without __init__.py) can be imported from too: `from nanovllm.engine import warmup`
PACKAGES = {module_name(p): p for p in sorted(PACKAGE.rglob("*")) if p.is_dir() and p.name != "__pycache__"}


def known(name: str) -> bool:
    return name in SOURCES or name in PACKAGES


def imports_of(module: str) -> set[str]:
    """Every nanovllm module `module` imports, wherever in the file the import sits."""
    path = SOURCES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:      # relative: from .x import y
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names if known(f"{source}.{alias.name}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("nanovllm."):
            if known(node.value):       # importlib.import_module("nanovllm....") and the tables that feed it
                found.add(node.value)
    return {name for name in found if name == "nanovllm" or name.startswith("nanovllm.")} - {module}


def floor_of(module: str) -> int:
    """The index in FLOORS of the floor that holds `module` (0 is the top)."""
    path = SOURCES.get(module) or PACKAGES[module]
    relative = path.relative_to(ROOT).as_posix() + ("/" if path.is_dir() else "")
    matches = [i for i, floor in enumerate(FLOORS) for place in floor.paths
               if relative == place or (place.endswith("/") and relative.startswith(place))]
    assert len(matches) == 1, f"{relative} is on {len(matches)} floors: give it exactly one in FLOORS"
    return matches[0]


GRAPH = {module: imports_of(module) for module in SOURCES}


def test_the_docstring_names_the_floors_in_order():
    listed = [line.split()[0] for line in __doc__.splitlines()
              if line.startswith("    ") and not line.startswith("     ")]
    assert listed == [floor.name for floor in FLOORS]


def test_the_parser_sees_lazy_and_by_name_imports():
    """Guards the guard: a function-level import and an import_module table are counted."""
    assert "nanovllm.utils.gguf_checkpoint" in GRAPH["nanovllm.entrypoints.terminal_chat"]   # inside a function
    assert "nanovllm.models.llama" in GRAPH["nanovllm.models"]          # the registry's import_module table
    assert "nanovllm.kernels.kv_tile" in GRAPH["nanovllm.kernels.decode_attention"]    # relative
    assert "nanovllm.engine.warmup" in GRAPH["nanovllm.engine.model_runner"]     # from a package import a module


def test_every_module_is_on_one_floor():
    for module in SOURCES:
        floor_of(module)


def test_imports_only_point_down():
    upward = [f"{module} ({FLOORS[floor_of(module)].name}) imports {target} ({FLOORS[floor_of(target)].name})"
              for module, targets in sorted(GRAPH.items()) for target in sorted(targets)
              if known(target) and floor_of(target) < floor_of(module)]
    assert not upward, "imports pointing up the floors:\n" + "\n".join(upward)


def test_every_import_names_a_module_that_exists():
    missing = [f"{module} imports {target}" for module, targets in sorted(GRAPH.items())
               for target in sorted(targets) if not known(target)]
    assert not missing, "\n".join(missing)


def test_no_import_cycle_between_floors():
    edges = {i: set() for i in range(len(FLOORS))}
    for module, targets in GRAPH.items():
        edges[floor_of(module)].update(floor_of(t) for t in targets if known(t) and floor_of(t) != floor_of(module))
    state = {}      # floor -> "visiting" or "done"

    def visit(floor: int, path: list[int]) -> None:
        state[floor] = "visiting"
        for target in sorted(edges[floor]):
            if state.get(target) == "visiting":
                cycle = path[path.index(target):] + [floor, target] if target in path else [floor, target]
                pytest.fail("floors in a cycle: " + " -> ".join(FLOORS[i].name for i in cycle))
            if target not in state:
                visit(target, path + [floor])
        state[floor] = "done"

    for floor in edges:
        if floor not in state:
            visit(floor, [])


def test_no_file_is_over_the_line_limit():
    too_long = []
    for path in SOURCES.values():
        relative, lines = path.relative_to(ROOT).as_posix(), len(path.read_text().splitlines())
        limit = LONG_FILES[relative][0] if relative in LONG_FILES else MAX_LINES
        if lines > limit:
            too_long.append(f"{relative}: {lines} lines (at most {limit})")
    assert not too_long, "split these along their seams:\n" + "\n".join(too_long)


@pytest.mark.parametrize("relative", sorted(LONG_FILES))
def test_each_long_file_exception_is_still_needed(relative):
    path = ROOT / relative
    assert path.is_file() and len(path.read_text().splitlines()) > MAX_LINES, \
        f"{relative} is no longer over {MAX_LINES} lines: drop it from LONG_FILES"
