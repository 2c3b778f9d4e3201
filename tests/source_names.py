"""What a piece of Python source takes from nanovllm, read from its syntax tree without running it."""
import ast
import importlib
import importlib.util


def nanovllm_imports(source: str) -> list[tuple[str, str | None]]:
    """(module, name) for every `from nanovllm... import name` in the source; (module, None) for
    `import nanovllm...`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nanovllm":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "nanovllm"]
    return found


def missing_names(source: str) -> list[str]:
    """The `module.name`s the source imports from nanovllm that nanovllm does not have."""
    missing = []
    for module_name, name in nanovllm_imports(source):
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name) and importlib.util.find_spec(f"{module_name}.{name}") is None:
            missing.append(f"{module_name}.{name}")
    return missing
