"""Pinning a finished turn's KV across an agent's tool call (Continuum's idea).

When an agent's turn ends in a tool call, its next turn comes back seconds later with the same
conversation plus the tool's result. Under load the prefix is evicted meanwhile and computed
again. A pin keeps the turn's cached blocks (one more user each) until its next turn is
admitted (which finds them as prefix hits) or its TTL runs out, whichever comes first.

- A request asks with `PinRequest`: a session key (a turn replaces its session's pin: one
  pinned turn per session) and a TTL, given (the client's `cache_control`) or, under the
  `continuum` scheduling policy, predicted from the gaps observed between a session's turn
  and its next (`ToolGapEstimator`: per tool, bounded).
- Pins live within a budget of the pool's blocks; over it the request is served and its pin
  refused (counted, and said in its final output).
- Pinned blocks are never evicted before their TTL. Under pressure, with a tier below the
  pool, the oldest pin moves down instead: its blocks are offered to the tier as they are
  released (engine/offload/), so the next turn loads them back rather than recomputing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import KVCacheBlock
from engine.pin_request import PinRequest
from engine.request import Request, RequestStatus

# Predicted TTLs stay within these bounds (seconds); an observed gap is stretched by the
# margin, so a turn a little later than the ones before still finds its prefix.
MIN_PREDICTED_TTL_S = 1.0
MAX_PREDICTED_TTL_S = 60.0
_MARGIN = 1.5
_DEFAULT_TTL_S = 5.0  # before any gap was seen
_GAPS_KEPT = 32  # per tool
_SESSIONS_KEPT = 4096  # sessions whose last turn's end is remembered (to measure a gap)
_FINISHED_WELL = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class ToolGapEstimator:
    """How long a tool takes, from the gaps seen so far: per tool, else over all tools."""

    def __init__(self) -> None:
        self._gaps: dict[str, list[float]] = {}
        self._all: list[float] = []

    def observe(self, tool: str, gap_s: float) -> None:
        for gaps in (self._gaps.setdefault(tool, []), self._all):
            gaps.append(gap_s)
            del gaps[:-_GAPS_KEPT]

    def predict(self, tool: str) -> float:
        """A TTL for a turn whose next tool is probably `tool`: the slower gaps seen (the
        90th percentile), with a margin, bounded."""
        gaps = self._gaps.get(tool) or self._all
        if not gaps:
            return _DEFAULT_TTL_S
        ordered = sorted(gaps)
        slow = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return min(MAX_PREDICTED_TTL_S, max(MIN_PREDICTED_TTL_S, slow * _MARGIN))


@dataclass
class _Pin:
    blocks: list[KVCacheBlock]
    expires: float  # time.monotonic()


@dataclass
class PinStats:
    pinned: int = 0  # turns pinned
    refused: int = 0  # over the budget: served, not pinned
    reused: int = 0  # released as their session's next turn was admitted
    expired: int = 0  # released at their TTL
    moved_down: int = 0  # released early into the tier below, under pressure
    gave_way: int = 0  # released early, no tier: a waiting request could not start otherwise
    replaced: int = 0  # released as their session's next turn was pinned in their place


class KVPins:
    def __init__(
        self,
        pool: BlockPool,
        budget: float,
        predict: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`budget`: the share of the pool's usable blocks pins may hold; `clock`: what
        TTLs run on (tests move it)."""
        self.clock = clock
        self._pool = pool
        self.budget_blocks = int(budget * (pool.num_blocks - 1))
        self._predict = predict  # continuum: pin sessions' turns with no TTL given
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # by session, oldest first
        self._num_blocks = 0
        self._turn_ends: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.estimator = ToolGapEstimator()
        self.stats = PinStats()

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def holds(self, key: str) -> bool:
        return key in self._pins

    def arrived(self, pin: PinRequest, arrival: float) -> None:
        """A session's turn arrived: the gap since its previous turn ended is its tool's."""
        ended = self._turn_ends.get(pin.key)
        if ended is not None and arrival >= ended[0]:
            self.estimator.observe(pin.after_tool or ended[1], arrival - ended[0])

    def goes_first(self, request: Request) -> bool:
        """A turn arrived. Under continuum, one whose session's pin holds its prefix is
        admitted first (before it expires, and so that no other turn takes its place)."""
        pin = request.pin
        if pin is None:
            return False
        self.arrived(pin, request.arrival_time)
        return self._predict and pin.key in self._pins

    def turn_finished(
        self, request: Request, status: RequestStatus, blocks: list[KVCacheBlock]
    ) -> None:
        """Pin a finished turn's blocks where it finished well and a TTL is asked or
        predicted; its timing's `pin_ttl_s` / `pin_refused` say what came of it."""
        pin = request.pin
        if pin is None or status not in _FINISHED_WELL:
            return
        if not _cached(blocks):
            return  # no whole block of it is cached: nothing to keep
        ttl = self.ttl_for(pin)
        if ttl is None:
            return
        if self.pin(pin, blocks, ttl):
            request.timing.pin_ttl_s = ttl
        else:
            request.timing.pin_refused = True

    def ttl_for(self, pin: PinRequest) -> float | None:
        """The TTL to pin a finished turn for: the one asked, or (continuum) predicted from
        the tool this session called last; None: not pinned."""
        if pin.ttl_s is not None:
            return pin.ttl_s
        return self.estimator.predict(pin.after_tool) if self._predict else None

    def pin(self, pin: PinRequest, blocks: list[KVCacheBlock], ttl_s: float) -> bool:
        """Pin a finished turn's cached `blocks` (the turn still holds them) for `ttl_s`.
        Replaces its session's pin. False (refused, counted) over the budget."""
        self._turn_ends[pin.key] = (time.time(), pin.after_tool)
        self._turn_ends.move_to_end(pin.key)
        while len(self._turn_ends) > _SESSIONS_KEPT:
            self._turn_ends.popitem(last=False)
        if self.release(pin.key) is not None:
            self.stats.replaced += 1  # a session keeps one pin: its newest turn's
        cached = _cached(blocks)
        if self._num_blocks + len(cached) > self.budget_blocks:
            self.stats.refused += 1
            return False
        self._pool.touch(cached)
        self._pins[pin.key] = _Pin(cached, self.clock() + ttl_s)
        self._num_blocks += len(cached)
        self.stats.pinned += 1
        return True

    def release(self, key: str) -> list[KVCacheBlock] | None:
        """Let go of the session's pin (tail first, as requests free); its blocks, or None."""
        pinned = self._pins.pop(key, None)
        if pinned is None:
            return None
        self._num_blocks -= len(pinned.blocks)
        self._pool.free_blocks(reversed(pinned.blocks))
        return pinned.blocks

    def reuse(self, key: str) -> None:
        """The session's next turn was admitted (holding its prefix now): the pin goes."""
        if self.release(key) is not None:
            self.stats.reused += 1

    def expire(self) -> None:
        """Release pins past their TTL (at the start of every step, before any allocation)."""
        if not self._pins:
            return
        now = self.clock()
        for key in [k for k, p in self._pins.items() if p.expires <= now]:
            self.release(key)
            self.stats.expired += 1

    def seconds_to_expiry(self) -> float | None:
        """Until the next pin's TTL ends (an idle engine wakes then to release it)."""
        if not self._pins:
            return None
        return max(0.0, min(p.expires for p in self._pins.values()) - self.clock())

    def oldest_freeing(self) -> tuple[str, list[KVCacheBlock]] | None:
        """The oldest pin whose release would free a block (none of its blocks used by
        anything else: releasing it would free nothing now), with its blocks; or None."""
        for key, pinned in self._pins.items():
            if any(block.ref_cnt == 1 for block in pinned.blocks):
                return key, pinned.blocks
        return None

    def release_all(self) -> None:
        for key in list(self._pins):
            self.release(key)

    def pinned_block_ids(self) -> list[int]:
        """One entry per pin holding a block (the manager's integrity check counts users)."""
        return [b.block_id for p in self._pins.values() for b in p.blocks]


def _cached(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    """The blocks holding a cached prefix (what a pin keeps)."""
    return [b for b in blocks if b.block_hash is not None and not b.is_null]
