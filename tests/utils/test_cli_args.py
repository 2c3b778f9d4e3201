"""Command-line options from dataclass fields (nanovllm.utils.cli_args): typed by the annotations,
booleans as bare flags with their negation, and only the options given come back."""
import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from nanovllm.utils.cli_args import add_dataclass_options, dataclass_kwargs

pytestmark = pytest.mark.cpu_only     # argument parsing only


@dataclass
class Settings:
    name: str
    eager: bool = False
    caching: bool = True
    size: int = 4
    share: float = 0.5
    seed: int | None = None
    dtype: str | torch.dtype = "auto"
    stop: str | list[str] | None = None
    ids: list[int] | None = None
    mode: Literal["fast", "slow"] = "fast"
    extra: dict = field(default_factory=dict)
    derived: int = field(init=False, default=0)


def parse(argv: list[str], skip=("name",)) -> dict:
    parser = argparse.ArgumentParser(prog="prog")
    add_dataclass_options(parser, Settings, "settings", skip=skip)
    return dataclass_kwargs(parser.parse_args(argv), Settings, skip=skip)


def test_options_not_given_are_left_to_the_dataclass_defaults():
    assert parse([]) == {}


def test_booleans_are_bare_flags_with_their_negation():
    assert parse(["--eager", "--no-caching"]) == {"eager": True, "caching": False}
    assert parse(["--no-eager", "--caching"]) == {"eager": False, "caching": True}
    assert parse(["--eager", "--no-eager"]) == {"eager": False}        # the last one wins


def test_values_take_the_annotated_types():
    got = parse(["--size", "8", "--share", "1", "--seed", "3", "--dtype", "bfloat16", "--mode", "slow",
                 "--extra", '{"a": 1}'])
    assert got == {"size": 8, "share": 1.0, "seed": 3, "dtype": "bfloat16", "mode": "slow", "extra": {"a": 1}}
    assert type(got["share"]) is float and type(got["size"]) is int
    assert parse(["--seed", "null"]) == {"seed": None}          # an Optional field can be set to None


def test_lists_take_json_or_one_bare_item():
    assert parse(["--stop", "\n\n"]) == {"stop": "\n\n"}
    assert parse(["--stop", '["a", "b"]']) == {"stop": ["a", "b"]}
    assert parse(["--stop", "[not json"]) == {"stop": "[not json"}     # a string that starts with [
    assert parse(["--ids", "[1, 2]"]) == {"ids": [1, 2]}
    assert parse(["--ids", "7"]) == {"ids": [7]}


@pytest.mark.parametrize("argv", [["--size", "eight"], ["--size", "1.5"], ["--share", "half"],
                                  ["--ids", "[1, true]"], ["--ids", "[1.5]"], ["--mode", "medium"],
                                  ["--eager", "true"], ["--unknown", "1"]])
def test_a_bad_value_is_argparses_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    assert "prog: error:" in capsys.readouterr().err


def test_a_field_without_default_is_a_required_option(capsys):
    assert parse(["--name", "x"], skip=()) == {"name": "x"}
    with pytest.raises(SystemExit):
        parse([], skip=())
    assert "--name" in capsys.readouterr().err


def test_help_shows_flags_types_and_defaults(capsys):
    parser = argparse.ArgumentParser(prog="prog")
    names = add_dataclass_options(parser, Settings, "settings", skip=("name",))
    assert names == ["eager", "caching", "size", "share", "seed", "dtype", "stop", "ids", "mode", "extra"]
    text = parser.format_help()
    assert "--eager, --no-eager" in text and "[--eager | --no-eager]" in text
    assert "--size INT" in text and "--share FLOAT" in text and "--dtype STR" in text
    assert "(default: 4)" in text and "(default: 'auto')" in text and "(default: True)" in text
    assert "--derived" not in text and "--name" not in text


@dataclass
class TextAnnotated:
    """Annotations as `from __future__ import annotations` leaves them, naming a module never imported here
    (as nanovllm.config names torch only for type checkers)."""
    dtype: "str | tensorlib.dtype" = "auto"
    size: "int" = 4
    seed: "int | None" = None
    eager: "bool" = False
    handle: "HandleOfSomeLibrary | None" = None
    derived: "SomeConfig" = field(init=False, default=None)


def test_string_annotations_resolve_without_their_imports():
    parser = argparse.ArgumentParser(prog="prog")
    add_dataclass_options(parser, TextAnnotated, "settings")
    text = parser.format_help()
    assert "--dtype STR" in text and "--size INT" in text and "--seed INT" in text and "--handle JSON" in text
    args = parser.parse_args(["--dtype", "bfloat16", "--size", "8", "--seed", "null", "--eager"])
    assert dataclass_kwargs(args, TextAnnotated) == {"dtype": "bfloat16", "size": 8, "seed": None, "eager": True}


def test_config_options_are_typed():
    """nanovllm.config keeps its annotations as text (it loads without torch): each option is still typed."""
    from nanovllm.config import Config
    parser = argparse.ArgumentParser(prog="prog")
    add_dataclass_options(parser, Config, "engine", skip=("model",))
    text = parser.format_help()
    for option in ("--max-model-len INT", "--gpu-memory-utilization FLOAT", "--dtype STR", "--kv-cache-dtype STR",
                   "--enforce-eager, --no-enforce-eager", "--quantization STR"):
        assert option in text
    assert "--hf-config" not in text and "--eos-token-ids" not in text
    args = parser.parse_args(["--max-model-len", "512", "--dtype", "float16", "--no-enable-prefix-caching"])
    assert dataclass_kwargs(args, Config, skip=("model",)) == {"max_model_len": 512, "dtype": "float16",
                                                               "enable_prefix_caching": False}
