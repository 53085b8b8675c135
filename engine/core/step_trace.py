"""The scheduler's per-step trace: why each step did what it did, kept in a ring buffer.

Off by default (`step_trace_size=0`): the scheduler then runs exactly as without it, not even a
check per step. On, the trace wraps the scheduler's decisions (`Scheduler._decide`), and every
step leaves one record of
- what the scheduler saw before deciding: the waiting, skipped (blocked) and running queues'
  sizes, and per KV tier its blocks in all, free and holding a cached prefix;
- what it decided: the requests it admitted new, resumed, kept running (tokens each) and
  preempted, those it admitted to load their KV from another engine first and those admitted
  once their load ended, and for each admitted one its prefix hits, once (tokens
  found in this engine's cache, tokens read from another engine, and whether that load runs
  while others compute).

The records are plain dicts (JSON as they are), the newest `size` of them kept. `pdserve trace
steps` fetches them from a running deployment (JSONL, or a Chrome / Perfetto trace file:
pdserve/trace_steps.py).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.sched_step import Step
    from engine.core.scheduler import Scheduler
    from engine.request import Request

PRIMARY = "primary"  # the engine's own KV pool (a tier below it is named by its backend)


class StepTrace:
    """The newest `size` steps' records of one scheduler, on the engine thread only (another
    thread asks for a copy through AsyncEngine.step_trace, taken between steps)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a step trace keeps at least 1 step, got {size}")
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self._next_step = 0

    def around(self, scheduler: Scheduler, decide: Callable[[], Step]) -> Callable[[], Step]:
        """`decide` (the scheduler's decisions for one step), recording each step it decides."""

        def traced() -> Step:
            record = self._before(scheduler)
            step = decide()
            self._records.append(_after(record, step))
            return step

        return traced

    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def _before(self, scheduler: Scheduler) -> dict[str, Any]:
        """What the scheduler sees as a step begins."""
        pool = scheduler.kv_cache_manager.block_pool
        tiers = {
            PRIMARY: {
                "blocks": pool.num_blocks - 1,  # block 0 is the null block
                "free": pool.get_num_free_blocks(),
                "cached": len(pool.cached_block_hash_to_block),
            }
        }
        tier = scheduler.tier
        for name, slots, used in tier.usage() if tier is not None else ():
            tiers[name] = {"blocks": slots, "free": slots - used, "cached": used}  # all cached
        record = {
            "step": self._next_step,
            "time": time.time(),
            "waiting": len(scheduler.waiting),
            "skipped_waiting": len(scheduler.skipped_waiting),
            "running": len(scheduler.running),
            "tiers": tiers,
            "pins": {"held": scheduler.pins.num_pins, "blocks": scheduler.pins.num_blocks},
        }
        self._next_step += 1
        return record


def _after(record: dict[str, Any], step: Step) -> dict[str, Any]:
    """`record` with the step's decisions."""
    tokens = step.num_scheduled
    loading = step.started_loading  # they wait for their KV, holding their blocks
    # A request whose load ended is admitted as new: its hits were counted when it began
    # loading (its load's end is when it was promoted).
    loaded = [r for r in step.scheduled_new if r.timing.kv_load_end is not None]
    fresh = [r for r in step.scheduled_new if r.timing.kv_load_end is None]
    admitted = [*fresh, *step.scheduled_resumed, *loading]
    record.update(
        {
            "new": {r.request_id: tokens[r.request_id] for r in step.scheduled_new},
            "resumed": {r.request_id: tokens[r.request_id] for r in step.scheduled_resumed},
            "kept_running": {r.request_id: tokens[r.request_id] for r in step.scheduled_running},
            "preempted": [r.request_id for r in step.preempted],
            "started_loading": [r.request_id for r in loading],
            "loaded": [r.request_id for r in loaded],
            "scheduled_tokens": sum(tokens.values()),
            "prefix_hits": {r.request_id: _hits(r, r in loading) for r in admitted},
        }
    )
    return record


def _hits(request: Request, loading: bool) -> dict[str, Any]:
    """An admitted request's prefix hits: the tokens it starts from, found in this engine's
    cache (local) and read from another engine (external). A request loading its KV has
    computed its local tokens only so far."""
    external = request.num_external_computed_tokens
    start = request.num_computed_tokens + (external if loading else 0)
    return {
        "prompt_tokens": request.num_prompt_tokens,
        "local": max(0, start - external),
        "external": external,
        "async_load": loading,
    }
