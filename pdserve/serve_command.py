"""`pdserve serve`: its flags and how they become the app's configuration
(deployments/app_config.py AppConfig) and the local launch (deployments/launch.py
ServeOptions).

Every AppConfig and ServeOptions field is a flag of the same name, with the field's default and
docstring (pdserve/flags.py): a setting is written in one place.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from deployments.app_config import AppConfig
from deployments.launch import APP_NAME, COLOCATED_APP_NAME, ServeOptions
from engine.config import KV_LOAD_FAILURE_POLICIES, KV_TRANSPORTS
from pdserve.flags import Flag, add_flags, named_json_object, read_flags

_APP_FLAGS = {
    "transport": Flag(choices=KV_TRANSPORTS),
    "kv_load_failure_policy": Flag(choices=KV_LOAD_FAILURE_POLICIES),
    "api_key": Flag(repeat=True),
}
# Secrets on a command line are seen by anyone who lists the processes: $PDSERVE_KV_SECRET.
_APP_SKIP = ("kv_secret",)
_LAUNCH_SKIP = ("extra_apps",)  # --with-colocated and --also-app
# The command's own defaults where the library's differ (a library start has neither).
_LAUNCH_DEFAULTS = {"dashboard_port": 8265, "metrics_export_port": 8080}


@dataclass
class ServeExtras:
    """`pdserve serve`'s flags beyond the app's and the launch's settings."""

    tokenizer: str | None = None
    """a directory with tokenizer.json (none: the model's own)"""
    dashboard: bool = True
    """start Ray's dashboard (Serve's CLI, `serve status`, talks to it)"""
    with_colocated: bool = False
    """also deploy the colocated app (route /colocated, gRPC app 'colocated') to compare side
    by side"""
    also_app: dict[str, dict[str, Any]] = field(default_factory=dict)
    """also deploy app NAME with these app-argument overrides, e.g.
    'untraced={"otlp_endpoint": ""}'"""


_EXTRA_FLAGS = {"also_app": Flag(parse=named_json_object, repeat=True, metavar="NAME=JSON")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, AppConfig, flags=_APP_FLAGS, skip=_APP_SKIP)
    launch = parser.add_argument_group("local launch")
    add_flags(launch, ServeOptions, skip=_LAUNCH_SKIP, defaults=_LAUNCH_DEFAULTS)
    add_flags(launch, ServeExtras, flags=_EXTRA_FLAGS)


def run(args: argparse.Namespace) -> int:
    from deployments.launch import run_until_interrupted

    extras = ServeExtras(**read_flags(args, ServeExtras, flags=_EXTRA_FLAGS))
    values = read_flags(args, AppConfig, flags=_APP_FLAGS, skip=_APP_SKIP)
    values["engine_args"] = _with_tokenizer(values["engine_args"], extras.tokenizer)
    config = AppConfig.from_args(values)
    _check_model(config.model, config.engine_args)
    options = ServeOptions(
        **read_flags(args, ServeOptions, skip=_LAUNCH_SKIP), extra_apps=_extra_apps(extras)
    )
    if not extras.dashboard:
        options.dashboard_port = None
    run_until_interrupted(config, options)
    return 0


def _extra_apps(extras: ServeExtras) -> dict[str, dict[str, Any]]:
    apps = dict(extras.also_app)
    if extras.with_colocated:
        apps[COLOCATED_APP_NAME] = {"colocated": True}
    if APP_NAME in apps:
        raise ValueError(f"{APP_NAME!r} is the main app's name; pick another")
    return apps


def _check_model(model: str, engine_args: dict[str, Any]) -> None:
    """Resolve (fetch) the model and read its config and tokenizer here, once: a model the
    engines cannot serve is then one line from this process, not a replica crash in Ray."""
    from engine.inputs import InputProcessor

    InputProcessor.from_args(model, **engine_args)


def _with_tokenizer(engine_args: dict[str, Any], tokenizer: str | None) -> dict[str, Any]:
    if tokenizer is None:
        return engine_args
    if engine_args.get("tokenizer", tokenizer) != tokenizer:
        raise ValueError("--tokenizer and --engine-args' tokenizer disagree; give one")
    return {**engine_args, "tokenizer": tokenizer}
