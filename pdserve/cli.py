"""`pdserve` command line. Every flag is a field of a configuration dataclass, its docstring the
flag's help (pdserve/flags.py): the app's (serve), the engine's (generate), the benchmarks'
and the commands' own (pdserve/cli_options.py). Ray starts inside the subcommands only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pdserve.cli_options import (
    ENGINE_FLAGS,
    PROMPT_FLAGS,
    ClientOptions,
    MakeModelOptions,
    PromptOptions,
    SamplingOptions,
    TraceSinkOptions,
)
from pdserve.flags import Flag, add_flags, read_flags


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        print(f"pdserve: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _add_generate(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import EngineArgs
    from engine.models.catalog import SMOLLM2_MODEL

    engine = parser.add_argument_group("engine arguments (vLLM's names)")
    add_flags(engine, EngineArgs, flags=ENGINE_FLAGS, defaults={"model": SMOLLM2_MODEL})
    _add_prompt_and_sampling(parser)


def _add_prompt_and_sampling(parser: argparse.ArgumentParser) -> None:
    """The prompt and sampling flags `generate` and `client` share."""
    add_flags(parser.add_argument_group("prompts"), PromptOptions, flags=PROMPT_FLAGS)
    add_flags(parser.add_argument_group("sampling"), SamplingOptions)


def _add_serve(parser: argparse.ArgumentParser) -> None:
    from pdserve import serve_command

    serve_command.add_arguments(parser)


def _add_client(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ClientOptions, flags={"tls_ca": Flag(metavar="PEM")})
    _add_prompt_and_sampling(parser)


def _add_trace_sink(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TraceSinkOptions)


def _add_trace(parser: argparse.ArgumentParser) -> None:
    from pdserve.trace_steps import TraceStepsOptions

    what = parser.add_subparsers(dest="trace", required=True, parser_class=_Parser)
    steps = what.add_parser("steps", help="the engines' per-step scheduler traces")
    add_flags(steps, TraceStepsOptions, flags={"tls_ca": Flag(metavar="PEM")})


def _add_download(parser: argparse.ArgumentParser) -> None:
    from pdserve.download import DownloadOptions

    add_flags(parser, DownloadOptions)


def _add_drain_node(parser: argparse.ArgumentParser) -> None:
    from pdserve.drain import DrainOptions

    add_flags(parser, DrainOptions)


def _add_make_model(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, MakeModelOptions)


# `pdserve bench NAME`: each module's CONFIG dataclass gives the flags (and its FLAGS, if any,
# how some are spelled); run(config) returns the JSON object printed.
_BENCHES = {
    "structured": "JSON-schema constraint cost per output token",
    "serve": "a running endpoint, streaming",
    "replay": "a recorded trace (Mooncake's format) against a running endpoint",
    "sched": "scheduler cost per step (no model)",
    "offline": "engine vs transformers.generate",
    "kv": "KV block transfer between two processes",
    "index": "the cluster KV index's lookup cost and size at many replicas (no Ray)",
    "router-sim": "the real routing code over simulated engines at cluster scale (no Ray)",
    "offload": "multi-turn past the KV pool, with and without a KV tier below it",
    "handoff": "TTFT of a prefill -> decode hand-off, and its KV checksums' share",
    "latency": "decode tokens/s against the bandwidth bound",
    "perplexity": "accuracy of quantized linears: perplexity, greedy agreement",
    "tp": "decode tokens/s at tensor_parallel_size N against 1, same cores",
    "spec": "n-gram speculative decoding vs plain, one stream",
    "chaos": "load on a local app while its replicas are killed",
    "gpu": "the prepared GPU check: Triton kernels, decode speed, parity, one JSON",
}


def _add_bench(parser: argparse.ArgumentParser, chosen: Sequence[str] | None) -> None:
    import importlib

    benches = parser.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, help_text in _BENCHES.items():
        bench = benches.add_parser(name, help=help_text)
        if chosen is None or chosen[:1] == [name]:
            module = importlib.import_module(_bench_module(name))
            add_flags(bench, module.CONFIG, flags=_flags(module))


def _bench_module(name: str) -> str:
    return f"pdserve.bench.{name.replace('-', '_')}"


def _flags(module: Any) -> dict[str, Flag]:
    return getattr(module, "FLAGS", {})


# Each command's help, and what adds its flags.
_COMMAND_FLAGS: dict[str, tuple[str, Any]] = {
    "generate": ("offline generation, no Ray", _add_generate),
    "serve": ("local Ray + the Serve app; blocks until Ctrl-C", _add_serve),
    "client": ("call the gRPC API", _add_client),
    "trace-sink": ("print OTLP/gRPC spans sent to it (dev tool)", _add_trace_sink),
    "trace": ("fetch traces from a running deployment (steps: the schedulers')", _add_trace),
    "download": ("fetch a model into a directory (init containers)", _add_download),
    "drain-node": ("move Serve's replicas off this Ray node (a pod's preStop)", _add_drain_node),
    "make-model": ("write the generated tiny test model", _add_make_model),
    "bench": ("benchmarks; each prints one JSON object", None),
}


def _build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given `argv`, with the flags of the command it names only. A command's
    flags may import the engine (torch: seconds), which `pdserve client` never needs."""
    positional = None if argv is None else [a for a in argv if not a.startswith("-")]
    parser = _Parser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add) in _COMMAND_FLAGS.items():
        command = commands.add_parser(name, help=help_text)
        if positional is not None and positional[:1] != [name]:
            continue
        if name == "bench":
            _add_bench(command, None if positional is None else positional[1:])
        else:
            add(command)
    return parser


def _prompts(args: argparse.Namespace) -> list[str | list[int]]:
    options = PromptOptions(**read_flags(args, PromptOptions, flags=PROMPT_FLAGS))
    prompts: list[str | list[int]] = [*options.prompt, *options.prompt_token_ids]
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-token-ids")
    return prompts


def _offline_prompt(prompt: str | list[int], raw: bool) -> str | list[int] | dict:
    """A --prompt is one user message unless --raw; token ids always go as they are."""
    if isinstance(prompt, str) and not raw:
        return {"messages": [{"role": "user", "content": prompt}]}
    return prompt


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams' arguments; max_tokens only where given (see SamplingOptions)."""
    options = SamplingOptions(**read_flags(args, SamplingOptions))
    kwargs = {
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "seed": options.sampling_seed,
        "ignore_eos": options.ignore_eos,
    }
    return {
        name: value for name, value in kwargs.items() if name != "max_tokens" or value is not None
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
    from engine.arg_utils import EngineArgs
    from engine.request import SamplingParams

    prompts = [_offline_prompt(p, args.raw) for p in _prompts(args)]
    kwargs = _sampling_kwargs(args)
    SamplingParams(**kwargs)  # bad sampling arguments fail before torch and the model load
    engine_args = read_flags(args, EngineArgs, flags=ENGINE_FLAGS)
    from engine.llm import LLM

    llm = LLM(**engine_args)
    params = [SamplingParams(**_offline_max_tokens(llm, prompt, kwargs)) for prompt in prompts]
    for output in llm.generate(prompts, params):
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


def _offline_max_tokens(llm: Any, prompt: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A chat without --max-tokens answers with what the context leaves after its prompt (as
    the server does); a raw prompt keeps SamplingParams' default."""
    if "max_tokens" in kwargs or not isinstance(prompt, dict):
        return kwargs
    _, token_ids = llm.inputs.encode(prompt)
    return {**kwargs, "max_tokens": max(1, llm.inputs.max_model_len - len(token_ids))}


def _run_client(args: argparse.Namespace) -> int:
    import grpc

    from engine.request import SamplingParams
    from pdserve.client import Completion, GenerationClient, generate_request

    SamplingParams(**_sampling_kwargs(args))  # the same checks (and messages) as generate
    requests = [
        generate_request(p, chat=not args.raw, **_sampling_kwargs(args)) for p in _prompts(args)
    ]
    options = ClientOptions(**read_flags(args, ClientOptions))
    with GenerationClient.connect(options) as client:
        try:
            for request in requests:
                completion = Completion()
                for response in client.stream(request, timeout=options.timeout):
                    completion.add(response)
                    if options.stream and not args.json:
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
                    print("" if options.stream else completion.text)
        except grpc.RpcError as exc:
            code = exc.code()
            print(f"pdserve: error: {code.name}: {exc.details()}", file=sys.stderr)
            return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    return 0


def _run_trace_sink(args: argparse.Namespace) -> int:
    from pdserve import trace_sink

    options = TraceSinkOptions(**read_flags(args, TraceSinkOptions))
    trace_sink.run(options.host, options.port, options.quiet)
    return 0


def _run_trace(args: argparse.Namespace) -> int:
    from pdserve import trace_steps

    options = trace_steps.TraceStepsOptions(**read_flags(args, trace_steps.TraceStepsOptions))
    return trace_steps.run(options)


def _run_make_model(args: argparse.Namespace) -> int:
    from engine.models import default_model

    options = MakeModelOptions(**read_flags(args, MakeModelOptions))
    seed = default_model.DEFAULT_SEED if options.seed is None else options.seed
    if options.path is None and options.seed is None:
        path = default_model.ensure_default_model()
    else:
        path = default_model.make_default_model(
            options.path or default_model.default_model_path(), seed
        )
    print(path)
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(_bench_module(args.bench))
    config = module.CONFIG(**read_flags(args, module.CONFIG, flags=_flags(module)))
    print(json.dumps(module.run(config), indent=2))
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from pdserve import serve_command

    return serve_command.run(args)


def _run_drain_node(args: argparse.Namespace) -> int:
    from pdserve import drain

    return drain.run(drain.DrainOptions(**read_flags(args, drain.DrainOptions)))


def _run_download(args: argparse.Namespace) -> int:
    from pdserve import download

    return download.run(download.DownloadOptions(**read_flags(args, download.DownloadOptions)))


_COMMANDS = {
    "generate": _run_generate,
    "serve": _run_serve,
    "client": _run_client,
    "trace-sink": _run_trace_sink,
    "trace": _run_trace,
    "make-model": _run_make_model,
    "download": _run_download,
    "drain-node": _run_drain_node,
    "bench": _run_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _build_parser(argv).parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ValueError as exc:  # bad input: one line, exit status 2, no traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
