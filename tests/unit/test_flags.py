"""Flags made from configuration dataclasses (pdserve/flags.py), and the `pdserve` command line
made with them: every flag of every command says what it does and its default, and the
settings a command reads are the dataclass's own."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

import pytest

from deployments.app_config import AppConfig
from deployments.launch import ServeOptions
from pdserve.cli import _BENCHES, _bench_module, _build_parser
from pdserve.flags import Flag, add_flags, field_docs, int_list, named_json_object, read_flags


@dataclass
class Options:
    port: int = 9000
    """where it listens (100% of the time)"""
    ratio: float | None = None
    """a fraction"""
    on: bool = True
    """switched on"""
    names: list[str] = field(default_factory=list)
    """names, one per flag"""
    extra: dict[str, Any] | None = None
    """more, as JSON"""
    sizes: tuple[int, ...] = (1, 32)
    """batch sizes"""


FLAGS = {"names": Flag(name="--name", repeat=True), "sizes": Flag(parse=int_list)}


def parse(*argv: str, **kwargs: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, Options, flags=FLAGS, **kwargs)
    return parser.parse_args(argv)


def test_a_flag_per_field_typed_by_its_annotation() -> None:
    args = parse(
        "--port", "80", "--ratio", "0.5", "--no-on", "--name", "a", "--name", "b",
        "--extra", '{"k": 1}', "--sizes", "1,2,3",
    )  # fmt: skip
    options = Options(**read_flags(args, Options, flags=FLAGS))
    assert options == Options(80, 0.5, False, ["a", "b"], {"k": 1}, (1, 2, 3))


def test_defaults_are_the_fields_unless_a_command_overrides_them() -> None:
    assert Options(**read_flags(parse(), Options, flags=FLAGS)) == Options()
    args = parse(defaults={"port": 1234})
    assert read_flags(args, Options, flags=FLAGS)["port"] == 1234


def test_help_is_the_field_docstring_with_its_default() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Options, flags=FLAGS)
    text = parser.format_help()
    assert "where it listens (100% of the time) (default: 9000)" in " ".join(text.split())
    assert "names, one per flag (repeatable; default: none)" in " ".join(text.split())
    assert "(default: 1,32)" in text


def test_bad_values_are_usage_errors() -> None:
    with pytest.raises(SystemExit):
        parse("--port", "eighty")
    with pytest.raises(SystemExit):
        parse("--extra", "[1]")  # not an object
    with pytest.raises(SystemExit):
        parse("--sizes", "1,x")


def test_a_field_without_a_docstring_cannot_become_a_flag() -> None:
    @dataclass
    class Undocumented:
        port: int = 1

    with pytest.raises(TypeError, match="no docstring"):
        add_flags(argparse.ArgumentParser(), Undocumented)


def test_a_field_without_a_default_is_a_required_flag() -> None:
    @dataclass
    class Required:
        name: str
        """a name"""

    parser = argparse.ArgumentParser()
    add_flags(parser, Required)
    assert "a name (required)" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args([])


def test_named_json_objects() -> None:
    assert named_json_object('pd={"a": 1}') == ("pd", {"a": 1})
    for bad in ("pd", 'p d={"a": 1}', "pd=[1]", "pd={"):
        with pytest.raises(argparse.ArgumentTypeError):
            named_json_object(bad)


def _subcommands(parser: argparse.ArgumentParser, path: str = "") -> dict[str, Any]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_subcommands(sub, f"{path} {name}".strip()))
    return found or {path: parser}


def test_every_flag_of_every_command_has_help_and_shows_its_default() -> None:
    commands = _subcommands(_build_parser())
    assert {"generate", "serve", "client", "bench sched", "bench chaos"} <= set(commands)
    missing = []
    for name, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = action.help or ""
            if "default:" not in text and "(required)" not in text:
                missing.append(f"{name} {action.option_strings}")
    assert missing == []


def test_serve_flags_are_the_app_and_launch_settings() -> None:
    commands = _subcommands(_build_parser())
    dests = {action.dest for action in commands["serve"]._actions}
    app_fields = {f.name for f in dataclasses.fields(AppConfig)} - {"kv_secret"}
    launch_fields = {f.name for f in dataclasses.fields(ServeOptions)} - {"extra_apps"}
    assert app_fields | launch_fields <= dests
    assert "kv_secret" not in dests  # a secret on a command line is anyone's to read
    args = _build_parser().parse_args(
        ["serve", "--max-local-prefill-tokens", "7", "--no-kv-aware-routing", "--api-key", "k"]
    )
    defaults = AppConfig()
    assert (args.max_local_prefill_tokens, args.kv_aware_routing) == (7, False)
    assert args.api_key == ["k"]
    assert args.min_prefix_loan_tokens == defaults.min_prefix_loan_tokens  # one default


@pytest.mark.parametrize("name", list(_BENCHES))
def test_every_bench_setting_is_a_flag_with_its_docstring(name: str) -> None:
    module = importlib.import_module(_bench_module(name))
    assert set(field_docs(module.CONFIG)) == {f.name for f in dataclasses.fields(module.CONFIG)}
    args = _build_parser().parse_args(["bench", name])
    config = module.CONFIG(**read_flags(args, module.CONFIG, flags=getattr(module, "FLAGS", {})))
    assert config == module.CONFIG()  # no flag given: the dataclass's own defaults


def test_bench_serve_slo_and_apps_flags() -> None:
    from pdserve.bench.serve import FLAGS, ServeBenchConfig

    slo = ["--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]
    deploy = ["--deploy", 'x={"colocated": true}', "--deploy", "y={}"]
    args = _build_parser().parse_args(["bench", "serve", *slo, "--app", "a", *deploy])
    config = ServeBenchConfig(**read_flags(args, ServeBenchConfig, flags=FLAGS))
    assert (config.slo_ttft_ms, config.slo_tpot_ms) == (500.0, 50.0)
    assert config.deploy == {"x": {"colocated": True}, "y": {}}
    assert config.apps == ["x", "y"]  # deployed configurations are the apps measured
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["bench", "serve", "--slo-ttft-ms", "fast"])
    twice = _build_parser().parse_args(["bench", "serve", "--deploy", "x={}", "--deploy", "x={}"])
    with pytest.raises(ValueError, match="once"):
        read_flags(twice, ServeBenchConfig, flags=FLAGS)
