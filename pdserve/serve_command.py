"""`pdserve serve`: its flags and how they become the app's configuration (deployments/app.py
AppConfig) and the local launch (deployments/launch.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from engine.config import KV_TRANSPORTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name",
        default="",
        help="the model name clients use (default: the model's short name or file stem)",
    )
    parser.add_argument("--prefill-replicas", type=int, default=1)
    parser.add_argument("--decode-replicas", type=int, default=1)
    parser.add_argument("--transport", choices=KV_TRANSPORTS, default="nixl")
    parser.add_argument("--colocated", action="store_true", help="one engine does both")
    parser.add_argument(
        "--with-colocated",
        action="store_true",
        help="also deploy the colocated app (route /colocated, gRPC app "
        "'colocated') to compare side by side",
    )
    parser.add_argument(
        "--also-app",
        type=_extra_app,
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also deploy app NAME with these app-argument overrides, e.g. "
        '\'untraced={"otlp_endpoint": ""}\' (repeatable)',
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="clients must send 'Authorization: Bearer KEY' (HTTP) or metadata "
        "'authorization: Bearer KEY' (gRPC); repeatable; also $PDSERVE_API_KEY, comma-separated",
    )
    parser.add_argument("--ssl-keyfile", default=None, help="TLS key (PEM): HTTPS, gRPC TLS port")
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    parser.add_argument(
        "--grpc-tls-port", type=int, default=9443, help="gRPC over TLS (with --ssl-certfile)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=9000)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument(
        "--dashboard-port",
        type=int,
        default=8265,
        help="Ray's dashboard, which Serve's CLI (serve status) talks to",
    )
    parser.add_argument("--no-dashboard", action="store_true", help="start Ray without it")
    parser.add_argument(
        "--metrics-export-port",
        type=int,
        default=8080,
        help="Prometheus metrics of every process, at /metrics",
    )
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's logical CPUs")
    parser.add_argument("--num-cpus-per-engine", type=float, default=1.0)
    parser.add_argument("--num-gpus-per-engine", type=float, default=0.0)
    for name, (default, help_text) in _ROUTE_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=default, help=help_text)
    parser.add_argument(
        "--no-pin-engine-cores",
        dest="pin_engine_cores",
        action="store_false",
        help="do not pin each engine replica's threads to cores of its own",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default="",
        help="OTLP/gRPC collector for traces (default: $OTEL_EXPORTER_OTLP_ENDPOINT, else off)",
    )
    parser.add_argument(
        "--engine-args",
        type=_json_object,
        default={},
        help="engine arguments as JSON, e.g. '{\"max_model_len\": 512}'",
    )
    from deployments.protocol import RequestLimits

    limits = parser.add_argument_group("request limits (refused beyond them, with the name)")
    for limit in fields(RequestLimits):
        limits.add_argument(
            f"--{limit.name.replace('_', '-')}",
            type=int,
            default=limit.default,
            help="default: %(default)s",
        )


def _extra_app(text: str) -> tuple[str, dict]:
    name, sep, overrides = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--also-app takes NAME=JSON, got {text!r}")
    return name, _json_object(overrides)


def _extra_apps(args: argparse.Namespace) -> dict[str, dict]:
    from deployments.launch import APP_NAME, COLOCATED_APP_NAME

    apps = dict(args.also_app)
    if args.with_colocated:
        apps[COLOCATED_APP_NAME] = {"colocated": True}
    if APP_NAME in apps:
        raise ValueError(f"{APP_NAME!r} is the main app's name; pick another")
    return apps


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _check_model(model: str, engine_args: dict) -> None:
    """Resolve (fetch) the model and read its config and tokenizer here, once: a model the
    engines cannot serve is then one line from this process, not a replica crash in Ray."""
    from engine.inputs import InputProcessor

    InputProcessor.from_args(model, **engine_args)


# `pdserve serve` flags that are AppConfig fields of the same name: default, help.
_ROUTE_FLAGS = {
    "min_remote_prefill_tokens": (0, "shorter prompts skip the prefill replica"),
    "max_local_prefill_tokens": (
        128,
        "a prompt of which a decode replica holds all but at most this many tokens skips the "
        "prefill replica (0: off; needs KV-aware routing)",
    ),
    "min_prefix_loan_tokens": (
        64,
        "the prefill replica borrows a prompt's cached blocks from the engine holding them "
        "when that spares at least this many tokens (0: off)",
    ),
}


def run(args: argparse.Namespace) -> int:
    from deployments.app import AppConfig
    from deployments.launch import ServeOptions, run_until_interrupted
    from deployments.protocol import RequestLimits

    config = AppConfig.from_args(
        {
            "model": args.model,
            "served_model_name": args.served_model_name,
            "prefill_replicas": args.prefill_replicas,
            "decode_replicas": args.decode_replicas,
            "transport": args.transport,
            "colocated": args.colocated,
            "num_cpus_per_engine": args.num_cpus_per_engine,
            "num_gpus_per_engine": args.num_gpus_per_engine,
            **{name: getattr(args, name) for name in _ROUTE_FLAGS},
            "pin_engine_cores": args.pin_engine_cores,
            "engine_args": _with_tokenizer(args.engine_args, args.tokenizer),
            "otlp_endpoint": args.otlp_endpoint,
            "api_key": args.api_key,
            **{limit.name: getattr(args, limit.name) for limit in fields(RequestLimits)},
        }
    )
    _check_model(config.model, config.engine_args)
    options = ServeOptions(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        num_cpus=args.num_cpus,
        extra_apps=_extra_apps(args),
        dashboard_port=None if args.no_dashboard else args.dashboard_port,
        metrics_export_port=args.metrics_export_port,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        grpc_tls_port=args.grpc_tls_port,
    )
    run_until_interrupted(config, options)
    return 0


def _with_tokenizer(engine_args: dict, tokenizer: str | None) -> dict:
    if tokenizer is None:
        return engine_args
    if engine_args.get("tokenizer", tokenizer) != tokenizer:
        raise ValueError("--tokenizer and --engine-args' tokenizer disagree; give one")
    return {**engine_args, "tokenizer": tokenizer}
