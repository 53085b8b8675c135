"""`pdserve bench sched`: scheduler + update_from_output cost per step on a fixed workload.

No model runs: FakeModelRunner samples one token per finished prefill, so the figures are the
CPU cost of scheduling alone, the part that sits between two forward passes.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.request import Request, SamplingParams
from engine.stats import scheduler_stats
from engine.testing.fake_runner import FakeModelRunner
from pdserve.bench.stats import summarize


@dataclass(frozen=True)
class SchedWorkload:
    num_requests: int = 512
    """requests, all queued at the start"""
    min_prompt: int = 128
    """prompt tokens at least"""
    max_prompt: int = 2048
    """prompt tokens at most"""
    shared_prefix_fraction: float = 0.3
    """requests whose prompt starts with the shared prefix"""
    shared_prefix_len: int = 512
    """tokens of the shared prefix"""
    min_output: int = 64
    """output tokens at least"""
    max_output: int = 256
    """output tokens at most"""
    num_blocks: int = 32768
    """KV blocks in the pool"""
    block_size: int = 16
    """tokens per KV block"""
    max_num_seqs: int = 256
    """requests in one step at most (the steady decode batch)"""
    max_num_batched_tokens: int = 8192
    """tokens in one step at most"""
    vocab_size: int = 32000
    """the fake model's vocabulary"""
    seed: int = 0
    """the workload's random draws"""
    step_trace_size: int = 0
    """also run the workload with the scheduler's step trace on (keeping this many steps),
    alternating with it off, `repeats` times each: what tracing adds to a step"""
    repeats: int = 3
    """runs of each, with --step-trace-size"""

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")


def make_requests(w: SchedWorkload) -> list[Request]:
    rng = random.Random(w.seed)
    prefix = [rng.randrange(w.vocab_size) for _ in range(w.shared_prefix_len)]
    requests = []
    for i in range(w.num_requests):
        length = rng.randint(w.min_prompt, w.max_prompt)
        if rng.random() < w.shared_prefix_fraction:
            body = [rng.randrange(w.vocab_size) for _ in range(max(0, length - len(prefix)))]
            prompt = (prefix + body)[:length]
        else:
            prompt = [rng.randrange(w.vocab_size) for _ in range(length)]
        params = SamplingParams(max_tokens=rng.randint(w.min_output, w.max_output), ignore_eos=True)
        requests.append(Request(f"req-{i}", prompt, params, arrival_time=float(i)))
    return requests


def run(w: SchedWorkload) -> dict[str, object]:
    if not w.step_trace_size:
        return _run_once(w, 0)
    runs: dict[str, list[dict[str, Any]]] = {"trace_off": [], "trace_on": []}
    for _ in range(w.repeats):
        runs["trace_off"].append(_run_once(w, 0))
        runs["trace_on"].append(_run_once(w, w.step_trace_size))
    # Each variant's fastest run (the least disturbed by the machine), by mean step time.
    best = {name: min(rs, key=lambda r: r["step_us"]["mean"]) for name, rs in runs.items()}
    added = {
        key: round(best["trace_on"][key]["mean"] - best["trace_off"][key]["mean"], 2)
        for key in ("step_us", "steady_decode_step_us")
    }
    return {
        "benchmark": "sched",
        "step_trace_size": w.step_trace_size,
        **best,
        "trace_adds_us": added,
    }


def _run_once(w: SchedWorkload, step_trace_size: int) -> dict[str, Any]:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=w.max_num_batched_tokens,
            max_num_seqs=w.max_num_seqs,
            max_model_len=w.max_prompt + w.max_output,
            step_trace_size=step_trace_size,
        ),
        CacheConfig(block_size=w.block_size, num_blocks=w.num_blocks),
    )
    runner = FakeModelRunner(w.block_size, w.num_blocks, w.vocab_size)
    for request in make_requests(w):
        scheduler.add_request(request)
    all_us: list[float] = []
    steady_us: list[float] = []  # steps that only decode, with the batch (nearly) full
    clock = time.perf_counter
    while scheduler.has_requests():
        t0 = clock()
        so = scheduler.schedule()
        t1 = clock()
        mro = runner.execute(so)
        t2 = clock()
        scheduler.update_from_output(so, mro)
        stats = scheduler_stats(scheduler)  # every engine step ships one with its outputs
        t3 = clock()
        step_us = ((t1 - t0) + (t3 - t2)) * 1e6
        all_us.append(step_us)
        num_reqs = len(so.num_scheduled_tokens)
        if num_reqs >= 0.97 * w.max_num_seqs and so.total_num_scheduled_tokens == num_reqs:
            steady_us.append(step_us)
    stats = scheduler_stats(scheduler)
    return {
        "benchmark": "sched",
        "workload": asdict(w),
        "steps": len(all_us),
        "step_us": summarize(all_us),
        "steady_decode_steps": len(steady_us),
        "steady_decode_step_us": summarize(steady_us),
        "preemptions": stats.num_preemptions,
        "prefix_hit_rate": round(stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), 4),
        "free_blocks_at_end": stats.num_free_blocks,
    }


CONFIG = SchedWorkload
