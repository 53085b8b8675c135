"""`pdserve bench serve`: load an endpoint over the streaming gRPC API.

Workloads (`--workload`, pdserve/bench/workloads.py): random prompts at a fixed concurrency or
with Poisson arrivals, multi-turn conversations, or steady decodes under bursts of long
prompts. Reports TTFT, TPOT, ITL and end-to-end latency, request and token throughput,
goodput under an SLO, prefill tokens computed and the prefix-cache hit rate, the routes taken;
per stream of the workload too. Several apps run the same workload one after another in one
run, with ratios against the first: Serve apps of a running endpoint (`--app`, e.g. the
disaggregated `pdserve` and the `colocated` app of `pdserve serve --with-colocated`), or
configurations the bench deploys itself on local Ray, each alone on the machine while it is
measured (`--deploy NAME=JSON`, app arguments over `--model`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from deployments.credentials import bearer, client_api_key
from pdserve.bench.stats import summarize
from pdserve.bench.workloads import (
    WORKLOADS,
    RequestResult,
    drive,
    make_prompts,
    max_tokens_needed,
    warmup_prompts,
)
from pdserve.client import APP_METADATA_KEY, generate_request
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

__all__ = ["RequestResult", "ServeBenchConfig", "make_prompts", "run"]

# p99.9 and the maximum: a prefill burst stalls every running stream once, a few ITLs in
# thousands, which p99 can miss entirely.
_QUANTILES = (0.5, 0.9, 0.99, 0.999)


@dataclass
class ServeBenchConfig:
    target: str = "127.0.0.1:9000"
    api_key: str = ""  # sent as `authorization: Bearer KEY` (a deployment with API keys)
    apps: list[str] = field(default_factory=lambda: ["pdserve"])  # Serve app names
    # Deploy these configurations one after another instead (name -> app arguments).
    deploy: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: str = "smollm2"  # what --deploy serves unless its arguments say otherwise
    num_cpus: int | None = None  # Ray's logical CPUs for --deploy
    workload: str = "random"
    num_prompts: int = 64  # requests (random), conversations (multiturn), steady (mixed)
    input_len: int = 128
    output_len: int = 64
    shared_prefix_len: int = 0
    concurrency: int | None = None  # default 8 without --request-rate
    request_rate: float | None = None  # requests/s (conversations/s), Poisson arrivals
    turns: int = 4  # multiturn
    turn_len: int = 32  # multiturn: new user tokens per later turn
    think_time_s: float = 1.0  # multiturn: mean pause between turns (exponential)
    long_input_len: int = 1024  # mixed: burst prompt length
    burst_output_len: int = 16  # mixed
    burst_size: int = 4  # mixed
    burst_interval_s: float = 5.0  # mixed
    warmup: int = 2
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    plot: str | None = None
    timeout_s: float = 600.0
    progress: bool = True
    interleave: bool = False  # run the apps at the same time instead of one after another

    def __post_init__(self) -> None:
        if self.deploy:
            self.apps = list(self.deploy)
        if not self.apps or len(set(self.apps)) != len(self.apps):
            raise ValueError(f"apps must be distinct names, got {self.apps}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}")
        if self.deploy and self.interleave:
            raise ValueError("--deploy runs one configuration at a time: no --interleave")
        for name in ("num_prompts", "input_len", "output_len", "turns", "turn_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("long_input_len", "burst_output_len", "burst_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.think_time_s < 0 or self.burst_interval_s <= 0:
            raise ValueError("think_time_s must be >= 0 and burst_interval_s > 0")
        if not 0 <= self.shared_prefix_len < self.input_len:
            raise ValueError("shared_prefix_len must be in [0, input_len)")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request_rate must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.request_rate is None and self.concurrency is None:
            self.concurrency = 8


async def _one(
    stub: pb_grpc.GenerationStub,
    prompt: list[int],
    output_len: int,
    config: ServeBenchConfig,
    metadata: Any,
) -> RequestResult:
    request = generate_request(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
    result = RequestResult(ok=False, num_prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=config.timeout_s, metadata=metadata):
            result.route = response.route or result.route
            if response.finish_reason:
                result.num_cached_tokens = response.usage.cached_tokens
            if not response.token_ids:
                continue
            now = time.perf_counter()
            if result.num_output_tokens == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.num_output_tokens += len(response.token_ids)
            result.token_ids.extend(response.token_ids)
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
        return result
    result.e2e_s = last - start
    result.ok = result.num_output_tokens > 0
    return result


async def _run_app(
    app: str, vocab_size: int, config: ServeBenchConfig, progress: Any
) -> tuple[list[RequestResult], float]:
    metadata = _metadata(app, config)
    async with grpc.aio.insecure_channel(config.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt in warmup_prompts(config, vocab_size):
            await _one(stub, prompt, config.output_len, config, metadata)
        results: list[RequestResult] = []
        start = time.perf_counter()

        async def send(prompt: list[int], output_len: int, kind: str) -> RequestResult:
            sent = time.perf_counter() - start
            result = await _one(stub, prompt, output_len, config, metadata)
            result.kind, result.start_s = kind, sent
            results.append(result)
            progress.update(1)
            return result

        await drive(config, vocab_size, send)
        return results, time.perf_counter() - start


async def _run_apps_together(
    vocab_size: int, config: ServeBenchConfig, progress: Any
) -> list[tuple[list[RequestResult], float]]:
    """Every app's workload at once: the machine's ups and downs hit them all alike, so their
    latencies compare fairly on a noisy host (their throughputs share the machine)."""
    runs = (_run_app(app, vocab_size, config, progress) for app in config.apps)
    return list(await asyncio.gather(*runs))


def summarize_results(
    results: list[RequestResult], duration_s: float, config: ServeBenchConfig
) -> dict[str, Any]:
    """The whole run's figures, and each stream's (`by_kind`) where the workload has several."""
    summary = _summary(results, duration_s, config)
    kinds = sorted({r.kind for r in results})
    if len(kinds) > 1:
        summary["by_kind"] = {
            kind: _summary([r for r in results if r.kind == kind], duration_s, config)
            for kind in kinds
        }
    return summary


def _summary(
    results: list[RequestResult], duration_s: float, config: ServeBenchConfig
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.num_output_tokens for r in ok)
    prompt_tokens = sum(r.num_prompt_tokens for r in ok)
    cached_tokens = sum(r.num_cached_tokens for r in ok)
    good = [r for r in ok if _meets_slo(r, config)]
    duration = max(duration_s, 1e-9)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((output_tokens + prompt_tokens) / duration, 2),
        "goodput": round(len(good) / duration, 3),
        # Prompt tokens some engine computed (the rest came from a prefix cache).
        "prefill_tokens_computed": prompt_tokens - cached_tokens,
        "prefix_hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "routes": dict(sorted(Counter(r.route or "none" for r in ok).items())),
        "ttft_ms": _ms([r.ttft_s for r in ok]),
        "tpot_ms": _ms([r.tpot_s for r in ok if r.num_output_tokens > 1]),
        "itl_ms": _ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": _ms([r.e2e_s for r in ok]),
    }


def _meets_slo(result: RequestResult, config: ServeBenchConfig) -> bool:
    if config.slo_ttft_ms is not None and result.ttft_s * 1e3 > config.slo_ttft_ms:
        return False
    return config.slo_tpot_ms is None or result.tpot_s * 1e3 <= config.slo_tpot_ms


def _ms(values_s: list[float]) -> dict[str, float]:
    summary = summarize([v * 1e3 for v in values_s], _QUANTILES)
    summary["max"] = round(max(values_s, default=0.0) * 1e3, 2)
    return summary


def ratios(first: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other / first for throughput, goodput, prefill work and latencies."""

    def ratio(a: float, b: float) -> float | None:
        return round(b / a, 3) if a else None

    out: dict[str, float | None] = {
        name: ratio(first[name], other[name])
        for name in ("output_token_throughput", "goodput", "prefill_tokens_computed")
        if name in first and name in other
    }
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for q in ("p50", "p99", "p99.9", "max"):
            key = f"{metric}_ms"
            if q in first.get(key, {}) and q in other.get(key, {}):
                out[f"{metric}_{q}"] = ratio(first[key][q], other[key][q])
    return out


def run(config: ServeBenchConfig) -> dict[str, Any]:
    from tqdm import tqdm

    raw: dict[str, list[RequestResult]] = {}
    report: dict[str, Any] = {"config": asdict(config), "results": {}}
    with tqdm(file=sys.stderr, disable=not config.progress, desc="bench serve", unit="req") as bar:
        if config.deploy:
            runs = [_deployed(name, config, bar) for name in config.deploy]
        else:
            vocab = _vocab_size(config)
            if config.interleave:
                runs = asyncio.run(_run_apps_together(vocab, config, bar))
            else:
                runs = [asyncio.run(_run_app(app, vocab, config, bar)) for app in config.apps]
        for app, (results, duration) in zip(config.apps, runs, strict=True):
            raw[app] = results
            report["results"][app] = summarize_results(results, duration, config)
    names = list(report["results"])
    if len(names) > 1:
        first = report["results"][names[0]]
        report["ratios"] = {
            f"{name}/{names[0]}": _ratios_by_kind(first, report["results"][name])
            for name in names[1:]
        }
    if config.plot:
        from pdserve.bench.serve_plot import plot

        plot(raw, config.plot)
        report["plot"] = config.plot
    return report


def _ratios_by_kind(first: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = ratios(first, other)
    for kind, summary in first.get("by_kind", {}).items():
        if kind in other.get("by_kind", {}):
            out[kind] = ratios(summary, other["by_kind"][kind])
    return out


def _deployed(
    name: str, config: ServeBenchConfig, progress: Any
) -> tuple[list[RequestResult], float]:
    """Start configuration `name` on local Ray, run the workload against it, stop it."""
    import dataclasses

    from deployments.app import AppConfig
    from deployments.launch import APP_NAME, ServeOptions, free_port, start, stop

    app = AppConfig.from_args({"model": config.model, **config.deploy[name]})
    grpc_port = free_port()
    print(f"bench serve: deploying {name!r}", file=sys.stderr, flush=True)
    # Ray forwards its processes' output to this one's stdout, which carries the JSON report:
    # while Ray runs here, stdout is stderr.
    with contextlib.redirect_stdout(sys.stderr):
        options = ServeOptions(grpc_port=grpc_port, http_port=free_port(), num_cpus=config.num_cpus)
        start(app, options)
        try:
            local = dataclasses.replace(
                config, target=f"127.0.0.1:{grpc_port}", apps=[APP_NAME], deploy={}
            )
            return asyncio.run(_run_app(APP_NAME, _vocab_size(local), local, progress))
        finally:
            stop()


def _metadata(app: str, config: ServeBenchConfig) -> tuple[tuple[str, str], ...]:
    return (((APP_METADATA_KEY, app),) if app else ()) + bearer(config.api_key)


def _vocab_size(config: ServeBenchConfig) -> int:
    app = config.apps[0]
    metadata = _metadata(app, config)
    with grpc.insecure_channel(config.target) as channel:
        info = pb_grpc.GenerationStub(channel).ModelInfo(
            pb.ModelInfoRequest(), timeout=30, metadata=metadata
        )
    needed = max_tokens_needed(config)
    if needed > info.max_model_len:
        raise ValueError(
            f"the {config.workload} workload reaches {needed} tokens, over the served "
            f"max_model_len={info.max_model_len}"
        )
    return int(info.vocab_size)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:9000", help="gRPC HOST:PORT")
    parser.add_argument(
        "--api-key",
        default=client_api_key(),
        help="for a deployment with API keys (default: $PDSERVE_API_KEY's first key)",
    )
    parser.add_argument(
        "--app",
        action="append",
        default=[],
        help="Serve app name (repeatable: compared side by side)",
    )
    parser.add_argument(
        "--deploy",
        action="append",
        default=[],
        type=_deploy_arg,
        metavar="NAME=JSON",
        help="deploy this configuration (app arguments) on local Ray, measure it alone, stop "
        "it; repeatable: the configurations one after another, e.g. "
        """'pd={"num_cpus_per_engine": 1}' 'colo={"colocated": true, "num_cpus_per_engine": 2}'""",
    )
    parser.add_argument("--model", default="smollm2", help="the model --deploy serves")
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's CPUs for --deploy")
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=64,
        help="requests; conversations (multiturn); steady requests (mixed)",
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shared-prefix-len", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson, requests/s")
    parser.add_argument("--turns", type=int, default=4, help="multiturn")
    parser.add_argument("--turn-len", type=int, default=32, help="multiturn: new tokens a turn")
    parser.add_argument("--think-time-s", type=float, default=1.0, help="multiturn: mean pause")
    parser.add_argument("--long-input-len", type=int, default=1024, help="mixed: burst prompts")
    parser.add_argument("--burst-output-len", type=int, default=16, help="mixed")
    parser.add_argument("--burst-size", type=int, default=4, help="mixed")
    parser.add_argument("--burst-interval-s", type=float, default=5.0, help="mixed")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", default="", help="e.g. ttft_ms=500,tpot_ms=50")
    parser.add_argument(
        "--plot", default=None, help="write a PNG: latency distributions, ITL over time"
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="load all --app at once (fair latency comparison on a noisy machine)",
    )
    parser.add_argument("--no-progress", action="store_true")


def _deploy_arg(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, args = text.partition("=")
    try:
        overrides = json.loads(args) if sep else None
    except json.JSONDecodeError:
        overrides = None
    if not name or not isinstance(overrides, dict):
        raise argparse.ArgumentTypeError(f"--deploy takes NAME=JSON object, got {text!r}")
    return name, overrides


def parse_slo(text: str) -> dict[str, float]:
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("ttft_ms", "tpot_ms"):
            raise ValueError(f"--slo takes ttft_ms=N,tpot_ms=N; got {part!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo {key} must be a number, got {value!r}") from None
    return slo


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    slo = parse_slo(args.slo)
    deploy = dict(args.deploy)
    if len(deploy) != len(args.deploy):
        raise ValueError("--deploy names must be distinct")
    return ServeBenchConfig(
        target=args.target,
        api_key=args.api_key,
        apps=args.app or ["pdserve"],
        deploy=deploy,
        model=args.model,
        num_cpus=args.num_cpus,
        workload=args.workload,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        turns=args.turns,
        turn_len=args.turn_len,
        think_time_s=args.think_time_s,
        long_input_len=args.long_input_len,
        burst_output_len=args.burst_output_len,
        burst_size=args.burst_size,
        burst_interval_s=args.burst_interval_s,
        warmup=args.warmup,
        seed=args.seed,
        slo_ttft_ms=slo.get("ttft_ms"),
        slo_tpot_ms=slo.get("tpot_ms"),
        plot=args.plot,
        progress=not args.no_progress,
        interleave=args.interleave,
    )
