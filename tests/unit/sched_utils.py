"""Helpers shared by scheduler tests: build a scheduler, requests, and drive steps."""

from __future__ import annotations

import zlib

from engine.config import CacheConfig, SchedulerConfig
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.outputs import EngineCoreOutput
from engine.request import Request, SamplingParams
from engine.testing.fake_runner import FakeModelRunner


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 128,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    connector=None,
    speculative=None,
    step_trace_size: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=policy,  # type: ignore[arg-type]
            step_trace_size=step_trace_size,
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        connector=connector,
        speculative=speculative,
    )


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        # Distinct per request id, so that only prompts a test spells out share prefixes.
        base = zlib.crc32(request_id.encode()) % 2**30
        prompt_ids = list(range(base, base + prompt))
    else:
        prompt_ids = prompt
    return Request(
        request_id,
        prompt_ids,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
    )


def runner_for(scheduler: Scheduler, check_kv: bool = True) -> FakeModelRunner:
    cache = scheduler.cache_config
    assert cache.num_blocks is not None
    return FakeModelRunner(cache.block_size, cache.num_blocks, vocab_size=1000, check_kv=check_kv)


def sampled_output(so: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """A runner output that samples `tokens[req_id]` (default: nothing) for each request."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [tokens.get(r, []) for r in req_ids])


def step(
    scheduler: Scheduler, runner: FakeModelRunner
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(so, runner.execute(so))
    scheduler.kv_cache_manager.check_integrity()
    return so, outputs


def run_to_completion(
    scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 10_000
) -> dict[str, EngineCoreOutput]:
    """Step until nothing is left; returns each request's final output."""
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return finals
        _, outputs = step(scheduler, runner)
        finals.update({o.request_id: o for o in outputs if o.finished})
    raise AssertionError(f"not finished after {max_steps} steps")


def cached_blocks(pool: BlockPool, hashes: list[bytes]) -> list[KVCacheBlock]:
    """Blocks of the pool held by one user, each cached under its hash."""
    blocks = pool.get_new_blocks(len(hashes))
    for block, block_hash in zip(blocks, hashes, strict=True):
        block.block_hash = block_hash
        pool.cached_block_hash_to_block.insert(block_hash, block)
    return blocks
