"""Command-line flags made from configuration dataclasses, as vLLM's EngineArgs makes its own.

One flag per field: `--field-name`, typed by the field's annotation, defaulting to the field's
default, with the docstring under the field as its help, the default shown after it. A setting
is written once — its field, with its default and its words — and a command, a serve config
and the library read the same thing. `Flag` spells a field differently where a command needs
it (another name, a parser for one value, choices, a repeatable flag).

    @dataclass
    class Options:
        port: int = 9000
        \"\"\"where it listens\"\"\"

    add_flags(parser, Options)              # --port PORT   where it listens (default: 9000)
    Options(**read_flags(args, Options))
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Flag:
    """How one field is spelled on the command line, where not simply `--field-name`."""

    name: str | None = None  # e.g. "--app" for a field `apps`
    parse: Callable[[str], Any] | None = None  # one command-line value -> the field's value
    choices: Sequence[Any] | None = None
    repeat: bool = False  # given once per value: the field is their list (its default if none)
    metavar: str | None = None
    help: str | None = None  # instead of the field's docstring (a command's own words)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: type,
    *,
    flags: Mapping[str, Flag] | None = None,
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """A flag for each field of the dataclass `config`, except those in `skip`. `defaults`
    replaces a field's default for this command (shown as such in --help)."""
    docs = field_docs(config)
    for item in dataclasses.fields(config):
        if item.name in skip or not item.init:
            continue
        flag = (flags or {}).get(item.name, Flag())
        help_text = flag.help or docs.get(item.name)
        if not help_text:
            raise TypeError(f"{config.__name__}.{item.name} has no docstring to show as help")
        default = (defaults or {}).get(item.name, _default(item))
        _add_one(parser, item.name, _annotation(config, item.name), flag, help_text, default)


def read_flags(
    args: argparse.Namespace,
    config: type,
    *,
    flags: Mapping[str, Flag] | None = None,
    skip: Collection[str] = (),
) -> dict[str, Any]:
    """The values `add_flags` parsed, by field name (a repeatable flag given no value reads as
    the field's default)."""
    values: dict[str, Any] = {}
    for item in dataclasses.fields(config):
        if item.name in skip or not item.init:
            continue
        value = getattr(args, item.name)
        flag = (flags or {}).get(item.name, Flag())
        if flag.repeat and value:
            value = type(_default(item))(value)
            if isinstance(value, dict) and len(value) != len(getattr(args, item.name)):
                raise ValueError(f"{item.name}: each name may be given once")
        elif flag.repeat:
            value = _default(item)
        values[item.name] = value
    return values


@functools.cache
def field_docs(config: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (and of its dataclass bases), one line."""
    docs: dict[str, str] = {}
    for cls in reversed(config.__mro__):
        if not dataclasses.is_dataclass(cls) or cls is object:
            continue
        (body,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
        assert isinstance(body, ast.ClassDef)
        for statement, following in zip(body.body, body.body[1:], strict=False):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def named_json_object(text: str) -> tuple[str, dict[str, Any]]:
    """NAME=JSON (an app and its argument overrides, say)."""
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(f"expected NAME=JSON object, got {text!r}")
    return name, json_object(value)


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def str_list(text: str) -> tuple[str, ...]:
    """Comma-separated names: "quantized,blocked"."""
    items = tuple(part.strip() for part in text.split(",") if part.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return items


def _default(item: dataclasses.Field[Any]) -> Any:
    """The field's default; dataclasses.MISSING for a field without one (a required flag)."""
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def _annotation(config: type, name: str) -> Any:
    """The field's type, its annotation resolved in the module of the class declaring it (a
    config may extend another module's)."""
    return typing.get_type_hints(config)[name]


def _add_one(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    annotation: Any,
    flag: Flag,
    help_text: str,
    default: Any,
) -> None:
    option = flag.name or "--" + name.replace("_", "-")
    help_text = help_text.replace("%", "%%")  # argparse formats help with %
    shown = _shown(default).replace("%", "%%")
    kwargs: dict[str, Any] = {"dest": name, "help": f"{help_text} (default: {shown})"}
    if flag.metavar:
        kwargs["metavar"] = flag.metavar
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
    base = _without_none(annotation)
    if default is dataclasses.MISSING:
        kwargs.update(required=True, help=f"{help_text} (required)")
        parser.add_argument(option, type=flag.parse or _parser_for(base), **kwargs)
    elif flag.repeat:
        # None when not given: argparse would append to a non-empty default list.
        kwargs["help"] = f"{help_text} (repeatable; default: {shown})"
        parser.add_argument(option, action="append", type=flag.parse or str, **kwargs)
    elif base is bool and flag.parse is None:
        # --name / --no-name. The default is set after: given to the action, argparse would
        # append a second "(default: ...)" to the help.
        parser.add_argument(option, action=argparse.BooleanOptionalAction, **kwargs)
        parser.set_defaults(**{name: default})
    else:
        parser.add_argument(option, type=flag.parse or _parser_for(base), default=default, **kwargs)


def _without_none(annotation: Any) -> Any:
    """`T | None` -> T; anything else as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _parser_for(annotation: Any) -> Callable[[str], Any]:
    if annotation in (int, float, str, Path):
        return annotation
    if typing.get_origin(annotation) is dict or annotation is dict:
        return json_object
    raise TypeError(f"no command-line parser for {annotation!r}: give the field a Flag(parse=)")


def _shown(default: Any) -> str:
    if isinstance(default, (list, tuple)):
        return ",".join(str(v) for v in default) if default else "none"
    if isinstance(default, dict):
        return json.dumps(default) if default else "none"
    if default == "":
        return '""'
    return "none" if default is None else str(default)
