"""`pdserve` command line. Heavy imports (ray, torch) stay inside the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks; each prints one JSON object")
    benches = bench.add_subparsers(dest="bench", required=True)
    from engine.benchmarks import sched

    sched_parser = benches.add_parser("sched", help="scheduler cost per step (no model)")
    sched.add_arguments(sched_parser)
    return parser


def _run_bench_sched(args: argparse.Namespace) -> int:
    from engine.benchmarks import sched

    print(json.dumps(sched.run(sched.workload_from_args(args)), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench" and args.bench == "sched":
            return _run_bench_sched(args)
    except ValueError as exc:  # bad input: one line, exit status 2, no traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
