"""`pdserve bench serve`: load a running endpoint over the streaming gRPC API.

Fixed concurrency or Poisson arrivals; random token-id prompts (optionally sharing a prefix),
fixed output lengths (ignore_eos). Reports TTFT, TPOT, ITL and end-to-end latency, request and
token throughput, and goodput under an SLO. Several Serve apps (`--app`, e.g. the disaggregated
`pdserve` and the `colocated` app of `pdserve serve --with-colocated`, or any `--also-app`) run
the same workload one after another in one run, with ratios against the first.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from deployments.client import APP_METADATA_KEY, generate_request
from pdserve.bench.stats import summarize
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

_QUANTILES = (0.5, 0.9, 0.99)
# Low ids hold the special tokens of small vocabularies: random prompts avoid them.
_FIRST_PLAIN_TOKEN = 16


@dataclass
class ServeBenchConfig:
    target: str = "127.0.0.1:9000"
    apps: list[str] = field(default_factory=lambda: ["pdserve"])  # Serve app names
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    shared_prefix_len: int = 0
    concurrency: int | None = None  # default 8 without --request-rate
    request_rate: float | None = None  # requests/s, Poisson arrivals
    warmup: int = 2
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    plot: str | None = None
    timeout_s: float = 600.0
    progress: bool = True
    interleave: bool = False  # run the apps at the same time instead of one after another

    def __post_init__(self) -> None:
        if not self.apps or len(set(self.apps)) != len(self.apps):
            raise ValueError(f"apps must be distinct names, got {self.apps}")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.shared_prefix_len < self.input_len:
            raise ValueError("shared_prefix_len must be in [0, input_len)")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request_rate must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.request_rate is None and self.concurrency is None:
            self.concurrency = 8


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0

    @property
    def tpot_s(self) -> float:
        if self.num_output_tokens < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def make_prompts(config: ServeBenchConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(config.seed)
    high = vocab_size - 1

    def draw(n: int) -> list[int]:
        return [rng.randint(_FIRST_PLAIN_TOKEN, high) for _ in range(n)]

    prefix = draw(config.shared_prefix_len)
    return [prefix + draw(config.input_len - len(prefix)) for _ in range(config.num_prompts)]


async def _one(
    stub: pb_grpc.GenerationStub, prompt: list[int], config: ServeBenchConfig, metadata: Any
) -> RequestResult:
    request = generate_request(
        prompt, max_tokens=config.output_len, temperature=0.0, ignore_eos=True
    )
    result = RequestResult(ok=False, num_prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=config.timeout_s, metadata=metadata):
            if not response.token_ids:
                continue
            now = time.perf_counter()
            if result.num_output_tokens == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.num_output_tokens += len(response.token_ids)
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
        return result
    result.e2e_s = last - start
    result.ok = result.num_output_tokens > 0
    return result


async def _run_app(
    app: str, prompts: list[list[int]], config: ServeBenchConfig, progress: Any
) -> tuple[list[RequestResult], float]:
    metadata = ((APP_METADATA_KEY, app),) if app else ()
    async with grpc.aio.insecure_channel(config.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt in prompts[: config.warmup]:
            await _one(stub, prompt, config, metadata)
        limit = asyncio.Semaphore(config.concurrency or len(prompts))
        rng = random.Random(config.seed + 1)

        async def bounded(prompt: list[int]) -> RequestResult:
            async with limit:
                result = await _one(stub, prompt, config, metadata)
            progress.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(bounded(prompt)))
            if config.request_rate is not None:
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def _run_apps_together(
    prompts: list[list[int]], config: ServeBenchConfig, progress: Any
) -> list[tuple[list[RequestResult], float]]:
    """Every app's workload at once: the machine's ups and downs hit them all alike, so their
    latencies compare fairly on a noisy host (their throughputs share the machine)."""
    return list(
        await asyncio.gather(*(_run_app(app, prompts, config, progress) for app in config.apps))
    )


def summarize_results(
    results: list[RequestResult], duration_s: float, config: ServeBenchConfig
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.num_output_tokens for r in ok)
    prompt_tokens = sum(r.num_prompt_tokens for r in ok)
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
    return summarize([v * 1e3 for v in values_s], _QUANTILES)


def ratios(first: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other / first for throughput and median latencies."""

    def ratio(a: float, b: float) -> float | None:
        return round(b / a, 3) if a else None

    return {
        "output_token_throughput": ratio(
            first["output_token_throughput"], other["output_token_throughput"]
        ),
        "ttft_p50": ratio(first["ttft_ms"]["p50"], other["ttft_ms"]["p50"]),
        "tpot_p50": ratio(first["tpot_ms"]["p50"], other["tpot_ms"]["p50"]),
        "e2e_p50": ratio(first["e2e_ms"]["p50"], other["e2e_ms"]["p50"]),
    }


def run(config: ServeBenchConfig) -> dict[str, Any]:
    from tqdm import tqdm

    vocab = _vocab_size(config)
    prompts = make_prompts(config, vocab)
    raw: dict[str, list[RequestResult]] = {}
    report: dict[str, Any] = {"config": asdict(config), "results": {}}
    with tqdm(
        total=len(prompts) * len(config.apps),
        file=sys.stderr,
        disable=not config.progress,
        desc="bench serve",
        unit="req",
    ) as progress:
        if config.interleave:
            runs = asyncio.run(_run_apps_together(prompts, config, progress))
        else:
            runs = [asyncio.run(_run_app(app, prompts, config, progress)) for app in config.apps]
        for app, (results, duration) in zip(config.apps, runs, strict=True):
            raw[app] = results
            report["results"][app] = summarize_results(results, duration, config)
    names = list(report["results"])
    if len(names) > 1:
        first = report["results"][names[0]]
        report["ratios"] = {
            f"{name}/{names[0]}": ratios(first, report["results"][name]) for name in names[1:]
        }
    if config.plot:
        plot(raw, config.plot)
        report["plot"] = config.plot
    return report


def _vocab_size(config: ServeBenchConfig) -> int:
    app = config.apps[0]
    metadata = ((APP_METADATA_KEY, app),) if app else ()
    with grpc.insecure_channel(config.target) as channel:
        info = pb_grpc.GenerationStub(channel).ModelInfo(
            pb.ModelInfoRequest(), timeout=30, metadata=metadata
        )
    if config.input_len + config.output_len > info.max_model_len:
        raise ValueError(
            f"input_len + output_len = {config.input_len + config.output_len} exceeds the "
            f"served max_model_len={info.max_model_len}"
        )
    return int(info.vocab_size)


def plot(raw: dict[str, list[RequestResult]], path: str) -> None:
    """Latency distributions (TTFT, TPOT, ITL, end-to-end), one colour per app."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = {
        "TTFT (ms)": lambda r: [r.ttft_s * 1e3],
        "TPOT (ms)": lambda r: [r.tpot_s * 1e3] if r.num_output_tokens > 1 else [],
        "ITL (ms)": lambda r: [x * 1e3 for x in r.itl_s],
        "end-to-end (ms)": lambda r: [r.e2e_s * 1e3],
    }
    for ax, (title, pick) in zip(axes.flat, panels.items(), strict=True):
        for app, results in raw.items():
            values = [v for r in results if r.ok for v in pick(r)]
            if values:
                ax.hist(values, bins=40, alpha=0.55, label=app)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:9000", help="gRPC HOST:PORT")
    parser.add_argument(
        "--app",
        action="append",
        default=[],
        help="Serve app name (repeatable: compared side by side)",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shared-prefix-len", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson, requests/s")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", default="", help="e.g. ttft_ms=500,tpot_ms=50")
    parser.add_argument("--plot", default=None, help="write a PNG of the latency distributions")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="load all --app at once (fair latency comparison on a noisy machine)",
    )
    parser.add_argument("--no-progress", action="store_true")


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
    return ServeBenchConfig(
        target=args.target,
        apps=args.app or ["pdserve"],
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        warmup=args.warmup,
        seed=args.seed,
        slo_ttft_ms=slo.get("ttft_ms"),
        slo_tpot_ms=slo.get("tpot_ms"),
        plot=args.plot,
        progress=not args.no_progress,
        interleave=args.interleave,
    )
