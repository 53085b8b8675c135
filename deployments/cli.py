"""`pdserve` command line. Heavy imports (ray, torch) stay inside the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
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


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model directory, or 'default'")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="engine seed (unseeded sampling)")


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="offline generation, no Ray")
    _add_engine_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="repeatable")
    parser.add_argument("--prompt-token-ids", type=_token_ids, action="append", default=[])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(commands)
    make_model = commands.add_parser("make-model", help="write the built-in default model")
    make_model.add_argument("--path", default=None, help="default: the cache directory")
    make_model.add_argument("--seed", type=int, default=None)
    bench = commands.add_parser("bench", help="benchmarks; each prints one JSON object")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    from engine.benchmarks import kv, offline, sched

    sched.add_arguments(benches.add_parser("sched", help="scheduler cost per step (no model)"))
    offline.add_arguments(benches.add_parser("offline", help="engine vs transformers.generate"))
    kv.add_arguments(benches.add_parser("kv", help="KV block transfer between two processes"))
    return parser


def _run_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.request import SamplingParams

    prompts: list[str | list[int]] = [*args.prompt, *args.prompt_token_ids]
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-token-ids")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
    )
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        if args.json:
            record = {
                "prompt_token_ids": output.prompt_token_ids,
                "token_ids": completion.token_ids,
                "text": completion.text,
                "finish_reason": completion.finish_reason,
            }
            print(json.dumps(record))
        else:
            print(completion.text)
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
    from engine.benchmarks import kv, offline, sched

    if args.bench == "sched":
        report = sched.run(sched.workload_from_args(args))
    elif args.bench == "kv":
        report = kv.run(kv.config_from_args(args))
    else:
        report = offline.run(offline.config_from_args(args))
    print(json.dumps(report, indent=2))
    return 0


_COMMANDS = {"generate": _run_generate, "make-model": _run_make_model, "bench": _run_bench}


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ValueError as exc:  # bad input: one line, exit status 2, no traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
