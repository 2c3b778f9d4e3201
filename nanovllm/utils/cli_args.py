"""Command-line options from a dataclass's fields, typed by its annotations, as vLLM's CLI spells them.

    group = add_dataclass_options(parser, SamplingParams, "sampling")
    args = parser.parse_args()
    params = SamplingParams(**dataclass_kwargs(args, SamplingParams))

A field `max_model_len: int` becomes `--max-model-len INT`; a `bool` field is a bare flag with its
negation (`--enforce-eager` / `--no-enforce-eager`). Options not given stay out of the namespace
(argparse.SUPPRESS), so `dataclass_kwargs` returns only what the user typed and the dataclass keeps its
own defaults. The dataclass is an argument: this module knows no setting of its own.
"""
import argparse
import builtins
import dataclasses
import json
import sys
import types
import typing
from typing import Any, Callable

NULL_WORDS = ("none", "null")


def _members(annotation) -> tuple[list, bool]:
    """A union's members without None, and whether None was one of them (`int | None` -> [int], True)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return [a for a in args if a is not type(None)], type(None) in args
    return [annotation], False


def _is_list(annotation) -> bool:
    return typing.get_origin(annotation) in (list, tuple) or annotation in (list, tuple)


def _named(name: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    convert.__name__ = name     # argparse's error reads "invalid <name> value: 'x'"
    return convert


def _json(text: str):
    """JSON where it parses (numbers, lists, dicts, true/null), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _list_of(item) -> Callable[[str], list]:
    """A JSON list of `item`s, or one bare item (`--stop-token-ids 7` -> [7])."""
    def one(value):
        if item is Any or (isinstance(value, item) and not (isinstance(value, bool) and item is not bool)):
            return value
        if isinstance(value, str):      # a bare item is still text: "7" -> 7
            return item(value)
        raise ValueError(f"not a {item.__name__}: {value!r}")

    def convert(text: str) -> list:
        value = _json(text)
        return [one(v) for v in (value if isinstance(value, list) else [text])]
    return _named(f"list[{getattr(item, '__name__', 'value')}]", convert)


def _str_or_list(text: str) -> str | list[str]:
    """`--stop '\\n\\n'` is one string; `--stop '["a", "b"]'` is a list of them."""
    value = _json(text) if text.lstrip().startswith("[") else text
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return text


def _or_null(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An Optional field: `null`/`none` gives None (for a field whose default is not None)."""
    def or_null(text: str):
        return None if text.strip().lower() in NULL_WORDS else convert(text)
    return _named(convert.__name__, or_null)


def _option(annotation) -> dict:
    """add_argument's keywords (type, metavar, action, choices) for one annotation."""
    members, optional = _members(annotation)
    if members == [bool]:
        return dict(action=argparse.BooleanOptionalAction)
    if len(members) == 1 and typing.get_origin(members[0]) is typing.Literal:
        choices = typing.get_args(members[0])
        return dict(type=type(choices[0]), choices=choices)
    if str in members:      # `str | torch.dtype`: a command line can only name it
        if any(_is_list(m) for m in members):
            return dict(type=_named("str or JSON list", _str_or_list), metavar="STR|JSON_LIST")
        return dict(type=str, metavar="STR")
    kwargs = None
    if set(members) <= {int, float}:
        number = float if float in members else int
        kwargs = dict(type=number, metavar=number.__name__.upper())
    elif len(members) == 1 and _is_list(members[0]):
        item = (typing.get_args(members[0]) or (Any,))[0]
        kwargs = dict(type=_list_of(item), metavar="JSON_LIST")
    if kwargs is None:      # anything else (a dict, a class): a JSON value
        return dict(type=_named("JSON", _json), metavar="JSON")
    if optional:
        kwargs["type"] = _or_null(kwargs["type"])
    return kwargs


class _Unnamed(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):       # typing's probes (__origin__, __args__, ...): a plain class
            raise AttributeError(name)
        return cls


class Unresolved(metaclass=_Unnamed):
    """What a name in a string annotation stands for when its module imports it only for type checkers
    (nanovllm.config names torch.dtype so, to load without torch): some type that no command line can
    spell. `str | torch.dtype` reads as `str | Unresolved`, which is all an option needs to know."""


class _Fallback(dict):
    """eval's locals for a string annotation: a name found nowhere (not in its module, not a builtin) is
    Unresolved, and so is any attribute of it."""

    def __init__(self, module_globals: dict):
        super().__init__()
        self.module_globals = module_globals

    def __missing__(self, name: str):
        if name in self.module_globals or hasattr(builtins, name):
            raise KeyError(name)        # eval goes on to the module's globals, then the builtins
        return Unresolved


def _annotations(cls) -> dict:
    """Each field's annotation as an object, string annotations (`from __future__ import annotations`)
    evaluated in the module of the class that declares the field, without importing anything."""
    declared = {}
    for klass in reversed(cls.__mro__):
        for name in vars(klass).get("__annotations__", {}):
            declared[name] = klass
    hints = {}
    for f in dataclasses.fields(cls):
        hints[f.name] = f.type
        if isinstance(f.type, str):
            module_globals = vars(sys.modules[declared.get(f.name, cls).__module__])
            try:
                hints[f.name] = eval(f.type, module_globals, _Fallback(module_globals))
            except Exception:       # not an expression of names: left as text (an option of strings)
                pass
    return hints


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, title: str,
                          skip: tuple[str, ...] = ()) -> list[str]:
    """One option per init field of dataclass `cls` (but those in `skip`), in a help group `title`;
    returns the field names. `field_name` is `--field-name`; dest is the field's name."""
    group = parser.add_argument_group(title)
    hints, names = _annotations(cls), []
    for field in dataclasses.fields(cls):
        if not field.init or field.name in skip:
            continue
        default = _default(field)
        required = default is dataclasses.MISSING
        kwargs = _option(hints.get(field.name, field.type))
        shown = "required" if required else f"default: {default!r}"
        group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, required=required,
                           default=argparse.SUPPRESS, help=f"({shown})".replace("%", "%%"), **kwargs)
        names.append(field.name)
    return names


def dataclass_kwargs(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The options of `cls` (added by add_dataclass_options with the same `skip`) that were given,
    as keyword arguments for `cls(...)`."""
    given = vars(args)
    return {f.name: given[f.name] for f in dataclasses.fields(cls)
            if f.init and f.name not in skip and f.name in given}
