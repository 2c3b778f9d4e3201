"""README.md's examples hold against the code: every Python block parses, imports only names nanovllm has
and passes `LLM`, `AsyncLLM`, `SamplingParams` and `StructuredOutputsParams` only keywords they take; every
command line of a shell block that runs `python bench.py`, `nanovllm serve|chat|batch` or `python -m
nanovllm.batch` is one its parser accepts. A renamed argument or a moved name fails here, on the CPU, not in
a newcomer's first paste. (The blocks that run on a CPU were run whole too: docs/benchmarks.md, thirty-fourth
session.)"""
import ast
import dataclasses
import re
import shlex
import textwrap
from pathlib import Path

import pytest
from source_names import missing_names

import bench
from nanovllm.batch import parse_args as batch_parse_args
from nanovllm.config import Config
from nanovllm.entrypoints.serve_command import build_parser as serve_parser
from nanovllm.entrypoints.terminal_chat import build_parser as chat_parser
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.cpu_only

FENCE = re.compile(r"^([ \t]*)```(\w*)\n(.*?)^\1```", re.M | re.S)
# the keywords each constructor takes; `model` is LLM's positional argument
KEYWORDS = {"LLM": {f.name for f in dataclasses.fields(Config) if f.init} - {"model"},
            "SamplingParams": {f.name for f in dataclasses.fields(SamplingParams) if f.init},
            "StructuredOutputsParams": {f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init}}
KEYWORDS["AsyncLLM"] = KEYWORDS["LLM"]
# the model directory a README command computes with $(python -c '...')
MODEL_SUBSTITUTION = re.compile(r"\"\$\(python -c '[^']*'\)\"")
SHELL_OPERATORS = {"&", "&&", "|", "||", ";", ">", ">>"}
COMMAND = re.compile(r"\s*([A-Z_]+=\S*\s+)*(python|nanovllm)\s")   # a line that runs python or nanovllm


def blocks(text: str, languages: set[str]) -> list[tuple[int, str]]:
    """(line number, dedented body) of every fenced block whose language is in `languages` ("" = none given)."""
    return [(text[:m.start()].count("\n") + 1, textwrap.dedent(m.group(3)))
            for m in FENCE.finditer(text) if m.group(2) in languages]


def unknown_keywords(source: str) -> list[str]:
    """`Class(keyword=...)` calls in the source whose keyword the class does not take."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in KEYWORDS:
            found += [f"{node.func.id}({kw.arg}=)" for kw in node.keywords
                      if kw.arg is not None and kw.arg not in KEYWORDS[node.func.id]]
    return found


def command_lines(text: str) -> list[tuple[int, list[str]]]:
    """(README line, argv) of each line of the shell blocks that runs python or nanovllm (continuations
    joined; comments, leading VAR=value assignments and everything from the first shell operator on left out)."""
    commands = []
    for fence_line, body in blocks(text, {"bash", "sh", ""}):
        pending = ""
        for offset, raw in enumerate(body.splitlines()):
            if not pending:
                line_number = fence_line + 1 + offset
            if raw.endswith("\\"):
                pending += raw[:-1] + " "
                continue
            line, pending = pending + raw, ""
            if not COMMAND.match(line):
                continue
            argv = shlex.split(MODEL_SUBSTITUTION.sub("MODEL", line), comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv = argv[1:]
            cut = next((i for i, arg in enumerate(argv) if arg in SHELL_OPERATORS), len(argv))
            if argv[:cut]:
                commands.append((line_number, argv[:cut]))
    return commands


def parser_of(argv: list[str]):
    """(the arguments, the function that parses them) for a command of ours; None for any other."""
    if argv[:2] == ["python", "bench.py"]:
        return argv[2:], bench.parse_args
    if argv[:3] == ["python", "-m", "nanovllm.batch"]:
        return argv[3:], batch_parse_args
    commands = {"serve": lambda args: serve_parser().parse_args(args), "batch": batch_parse_args,
                "chat": lambda args: chat_parser().parse_args(args)}
    if argv[:1] == ["nanovllm"] and len(argv) > 1 and argv[1] in commands:
        return argv[2:], commands[argv[1]]
    return None


PYTHON_BLOCKS = blocks(README, {"python"})
OUR_COMMANDS = [(line, argv) for line, argv in command_lines(README) if parser_of(argv) and "--help" not in argv]


def test_the_readme_has_what_these_tests_read():
    assert len(PYTHON_BLOCKS) >= 15
    assert sum(argv[:2] == ["python", "bench.py"] for _, argv in OUR_COMMANDS) >= 5
    assert sum(argv[:2] == ["nanovllm", "serve"] for _, argv in OUR_COMMANDS) >= 2
    assert any(argv[:3] == ["python", "-m", "nanovllm.batch"] for _, argv in OUR_COMMANDS)


def test_the_checks_catch_a_wrong_example():
    source = ("from nanovllm import LLM, SamplingParams, Sampler\n"
              "LLM('m', kv_block_size=16, max_model_len=64)\nSamplingParams(temprature=0.5, top_p=0.9)\n")
    assert missing_names(source) == ["nanovllm.Sampler"]
    assert unknown_keywords(source) == ["LLM(kv_block_size=)", "SamplingParams(temprature=)"]
    text = ("```bash\nPYTHONPATH=. python bench.py --shape qwen3-8b \\\n  --kv-block-size 16 > log  # a comment\n"
            "nanovllm serve \"$(python -c 'import x; print(x.y())')\" --port 8000 &\n```\n")
    (_, bench_argv), (_, serve_argv) = command_lines(text)
    assert bench_argv == ["python", "bench.py", "--shape", "qwen3-8b", "--kv-block-size", "16"]
    assert serve_argv == ["nanovllm", "serve", "MODEL", "--port", "8000"]
    args, parse = parser_of(bench_argv)
    with pytest.raises(SystemExit):
        parse(args)


@pytest.mark.parametrize("line, source", PYTHON_BLOCKS, ids=[f"line{line}" for line, _ in PYTHON_BLOCKS])
def test_a_python_example_names_what_nanovllm_has(line, source):
    ast.parse(source)
    assert not missing_names(source), f"README line {line} imports what nanovllm does not have"
    assert not unknown_keywords(source), f"README line {line} passes keywords nothing takes"


@pytest.mark.parametrize("line, argv", OUR_COMMANDS, ids=[f"line{line}-{argv[1]}" for line, argv in OUR_COMMANDS])
def test_a_command_line_is_one_its_parser_accepts(line, argv, capsys):
    args, parse = parser_of(argv)
    try:
        parse(args)
    except SystemExit as error:
        pytest.fail(f"README line {line}: {' '.join(argv)} is refused: {capsys.readouterr().err.strip()} ({error})")
