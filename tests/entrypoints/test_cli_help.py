"""`nanovllm --help` and each command's help answer without importing torch or transformers (seconds of
imports for a screen of text): the package imports its classes lazily, nanovllm.config imports torch only
when a Config is built, and the commands import their engines only when they run. Asserted on the imports
(`python -X importtime`), not on wall time."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu_only     # help screens: not even torch is imported

HEAVY = ("torch", "transformers", "triton", "numpy", "fastapi", "uvicorn")
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}


def imported_modules(args: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime ARGS`; its result and every module it imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                            timeout=60, env=ENV)
    modules = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    return result, modules


@pytest.mark.parametrize("command", [["--help"], ["serve", "--help"], ["chat", "--help"], ["serve"]])
def test_help_imports_no_engine(command):
    result, modules = imported_modules(["-m", "nanovllm.entrypoints.cli", *command])
    if command == ["serve"]:     # a missing MODEL is argparse's error, also before any engine import
        assert result.returncode == 2 and "the following arguments are required: model" in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith("usage: nanovllm")
    assert "nanovllm.entrypoints" in modules
    if command != ["--help"]:       # the command's parser holds every LLM argument: Config's fields
        assert "nanovllm.config" in modules
    assert not [name for name in HEAVY if name in modules]


def test_python_m_serve_help_imports_no_engine():
    result, modules = imported_modules(["-m", "nanovllm.serve", "--help"])
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m nanovllm.serve")
    assert "nanovllm.config" in modules
    assert not [name for name in HEAVY if name in modules]


def test_package_imports_lazily():
    """`import nanovllm` imports no engine; its names import their modules on first use."""
    script = ("import sys, nanovllm\n"
              "assert 'torch' not in sys.modules, 'import nanovllm imported torch'\n"
              "assert set(nanovllm.__all__) <= set(dir(nanovllm))\n"
              "from nanovllm import SamplingParams\n"
              "assert SamplingParams().max_tokens > 0\n"
              "assert 'torch' not in sys.modules, 'SamplingParams imported torch'\n"
              "from nanovllm import LLM, AsyncLLM, EngineDeadError\n"
              "assert issubclass(EngineDeadError, RuntimeError) and LLM.__name__ == 'LLM'\n"
              "assert nanovllm.AsyncLLM is AsyncLLM\n"
              "try:\n"
              "    nanovllm.NoSuchName\n"
              "except AttributeError:\n"
              "    pass\n"
              "else:\n"
              "    raise AssertionError('nanovllm.NoSuchName')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
