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

import asyncio
import contextlib
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

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
from pdserve.flags import Flag, named_json_object
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

__all__ = ["RequestResult", "ServeBenchConfig", "make_prompts", "run"]

# p99.9 and the maximum: a prefill burst stalls every running stream once, a few ITLs in
# thousands, which p99 can miss entirely.
_QUANTILES = (0.5, 0.9, 0.99, 0.999)


@dataclass
class ServeBenchConfig:
    target: str = "127.0.0.1:9000"
    """the gRPC endpoint, HOST:PORT"""
    api_key: str | None = None
    """sent as 'authorization: Bearer KEY' (none: $PDSERVE_API_KEY's first key, if any)"""
    apps: list[str] = field(default_factory=lambda: ["pdserve"])
    """Serve app names, compared side by side (e.g. pdserve serve --with-colocated's)"""
    deploy: dict[str, dict[str, Any]] = field(default_factory=dict)
    """deploy each configuration (NAME=app arguments as JSON) on local Ray in turn and measure
    it alone, instead of an endpoint that runs, e.g. 'pd={"num_cpus_per_engine": 1}'"""
    model: str = "smollm2"
    """what --deploy serves unless its arguments say otherwise"""
    num_cpus: int | None = None
    """Ray's logical CPUs for --deploy (none: enough for every replica)"""
    workload: str = "random"
    """random, multiturn (conversations behind a shared system prompt), mixed (steady
    decodes under bursts of long prompts) or replay (a recorded trace: --trace)"""
    num_prompts: int = 64
    """requests (random); conversations (multiturn); steady requests (mixed)"""
    input_len: int = 128
    """prompt tokens"""
    output_len: int = 64
    """output tokens"""
    shared_prefix_len: int = 0
    """leading prompt tokens every request shares"""
    concurrency: int | None = None
    """requests in flight at once (none: 8 without a request rate)"""
    request_rate: float | None = None
    """requests (conversations) per second, Poisson arrivals (none: as fast as concurrency
    allows)"""
    turns: int = 4
    """multiturn: turns per conversation"""
    turn_len: int = 32
    """multiturn: new user tokens per later turn"""
    think_time_s: float = 1.0
    """multiturn: mean pause between turns (exponential)"""
    tool_gap_s: float = 2.0
    """agentic: a tool call's mean time (each tool's is a share of it)"""
    background_prompts: int = 16
    """agentic: one-shot prompts sent beside the sessions"""
    background_input_len: int = 0
    """agentic: the one-shot prompts' tokens (0: input_len)"""
    background_rate: float = 1.0
    """agentic: one-shot prompts a second (Poisson)"""
    background_output_len: int = 8
    """agentic: the one-shot prompts' output tokens"""
    long_input_len: int = 1024
    """mixed: the bursts' prompt tokens"""
    burst_output_len: int = 16
    """mixed: the bursts' output tokens"""
    burst_size: int = 4
    """mixed: requests per burst"""
    burst_every: int = 8
    """mixed: a burst as every this many steady requests start (counted in requests, not
    seconds: every configuration compared gets the same bursts)"""
    trace: str | None = None
    """replay: a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length,
    hash_ids of 512-token blocks)"""
    trace_token_scale: float = 1 / 32
    """replay: token counts (and the 512-token blocks) times this"""
    trace_time_scale: float = 1.0
    """replay: the trace's clock times this (2: half the request rate)"""
    trace_max_requests: int = 100
    """replay: the trace's first this many requests (0: all)"""
    warmup: int = 2
    """requests sent before the measured ones"""
    seed: int = 0
    """the workload's random choices"""
    slo_ttft_ms: float | None = None
    """goodput counts requests whose time to first token is within this"""
    slo_tpot_ms: float | None = None
    """goodput counts requests whose time per output token is within this"""
    plot: str | None = None
    """write a PNG here: latency distributions, ITL over time"""
    timeout_s: float = 600.0
    """a request's deadline"""
    progress: bool = True
    """a progress bar on stderr"""
    interleave: bool = False
    """load all apps at once instead of one after the other (a fair latency comparison on a
    noisy machine)"""

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
        for name in ("long_input_len", "burst_output_len", "burst_size", "burst_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.think_time_s < 0 or self.tool_gap_s < 0:
            raise ValueError("think_time_s and tool_gap_s must be >= 0")
        if self.background_prompts < 0 or self.background_input_len < 0:
            raise ValueError("background_prompts and background_input_len must be >= 0")
        if self.background_rate <= 0 or self.background_output_len < 1:
            raise ValueError("background_rate must be > 0 and background_output_len >= 1")
        if self.trace is not None and self.workload != "replay":
            raise ValueError("--trace is for the replay workload only")
        if self.trace_token_scale <= 0 or self.trace_time_scale <= 0:
            raise ValueError("trace_token_scale and trace_time_scale must be > 0")
        if self.trace_max_requests < 0:
            raise ValueError("trace_max_requests must be >= 0")
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
    pin: pb.KVPin | None = None,
) -> RequestResult:
    request = generate_request(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if pin is not None:  # an agent's session (and the tool it follows): the engine may pin
        request.pin.CopyFrom(pin)
    result = RequestResult(ok=False, num_prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=config.timeout_s, metadata=metadata):
            result.route = response.route or result.route
            if response.finish_reason:
                result.num_cached_tokens = response.usage.cached_tokens
                result.pinned = response.usage.pinned_ttl_s > 0
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


class AppRun(NamedTuple):
    results: list[RequestResult]
    duration_s: float
    # Tensor-parallel engines: per role, ranks and rank 0's share of the run in collectives.
    parallel: dict[str, dict[str, float]]


async def _run_app(app: str, vocab_size: int, config: ServeBenchConfig, progress: Any) -> AppRun:
    metadata = _metadata(app, config)
    async with grpc.aio.insecure_channel(config.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt in warmup_prompts(config, vocab_size):
            await _one(stub, prompt, config.output_len, config, metadata)
        results: list[RequestResult] = []
        before = await _engines(stub, metadata)
        start = time.perf_counter()

        async def send(
            prompt: list[int], output_len: int, kind: str, session: str = "", after_tool: str = ""
        ) -> RequestResult:
            sent = time.perf_counter() - start
            pin = pb.KVPin(session=session, after_tool=after_tool) if session else None
            result = await _one(stub, prompt, output_len, config, metadata, pin)
            result.kind, result.start_s = kind, sent
            results.append(result)
            progress.update(1)
            return result

        await drive(config, vocab_size, send)
        duration = time.perf_counter() - start
        after = await _engines(stub, metadata)
        return AppRun(results, duration, _collective_shares(before, after, duration))


async def _engines(stub: Any, metadata: Any) -> dict[str, pb.EngineStats]:
    """Every engine replica's statistics, by replica id (the app's Health)."""
    health = await stub.Health(pb.HealthRequest(), timeout=30, metadata=metadata)
    return {engine.replica_id: engine for engine in health.engines}


def _collective_shares(
    before: dict[str, pb.EngineStats], after: dict[str, pb.EngineStats], duration_s: float
) -> dict[str, dict[str, float]]:
    """Per role of split engines: their ranks, and the most any replica's rank 0 spent in
    all-reduce and all-gather, as a share of the run."""
    shares: dict[str, dict[str, float]] = {}
    for replica_id, engine in after.items():
        if engine.tensor_parallel_size <= 1 or replica_id not in before:
            continue
        spent = engine.tp_collective_seconds - before[replica_id].tp_collective_seconds
        role = shares.setdefault(engine.role, {"tensor_parallel_size": engine.tensor_parallel_size})
        share = round(spent / max(duration_s, 1e-9), 4)
        role["collective_share"] = max(role.get("collective_share", 0.0), share)
    return shares


async def _run_apps_together(
    vocab_size: int, config: ServeBenchConfig, progress: Any
) -> list[AppRun]:
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
        "pinned": sum(r.pinned for r in ok),  # turns whose KV an engine kept for the next
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
        for app, run_ in zip(config.apps, runs, strict=True):
            raw[app] = run_.results
            report["results"][app] = summarize_results(run_.results, run_.duration_s, config)
            if run_.parallel:
                report["results"][app]["tensor_parallel"] = run_.parallel
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


def _deployed(name: str, config: ServeBenchConfig, progress: Any) -> AppRun:
    """Start configuration `name` on local Ray, run the workload against it, stop it."""
    import dataclasses

    from deployments.app_config import AppConfig
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
    api_key = client_api_key() if config.api_key is None else config.api_key
    return (((APP_METADATA_KEY, app),) if app else ()) + bearer(api_key)


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


CONFIG = ServeBenchConfig
FLAGS = {
    "apps": Flag(name="--app", repeat=True),
    "deploy": Flag(parse=named_json_object, repeat=True, metavar="NAME=JSON"),
    "workload": Flag(choices=WORKLOADS),
}
