"""Pins of finished turns' KV (engine/core/pins.py): the budget, one pin per session, release
at the next turn or at the TTL, and the TTL predicted from tool-call gaps."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool
from engine.core.pins import MAX_PREDICTED_TTL_S, MIN_PREDICTED_TTL_S, KVPins, ToolGapEstimator
from engine.pin_request import PinRequest
from engine.request import Request, RequestStatus, SamplingParams
from tests.unit.sched_utils import cached_blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pin_holds_its_blocks_until_its_ttl_and_frees_them_after():
    pool, clock = BlockPool(11, enable_caching=True), Clock()
    pins = KVPins(pool, 0.5, predict=False, clock=clock)
    blocks = cached_blocks(pool, [b"a", b"b", b"c"])
    assert pins.pin(PinRequest("s", ttl_s=5.0), blocks, 5.0)
    pool.free_blocks(blocks)  # the turn ends; the pin keeps them
    assert pool.get_num_free_blocks() == 7 and pins.num_blocks == 3
    clock.now += 4.9
    pins.expire()
    assert pins.holds("s")
    clock.now += 0.2
    pins.expire()
    assert not pins.holds("s") and pool.get_num_free_blocks() == 10
    assert pins.stats.expired == 1 and pins.stats.pinned == 1
    assert pool.get_cached_block(b"a") is not None  # free, still cached: evictable again


def test_pins_over_the_budget_are_refused_and_a_session_holds_one():
    pool = BlockPool(11, enable_caching=True)  # 10 usable: a budget of 0.5 is 5 blocks
    pins = KVPins(pool, 0.5, predict=False, clock=Clock())
    first = cached_blocks(pool, [b"a", b"b", b"c"])
    assert pins.pin(PinRequest("s"), first, 1.0)
    assert not pins.pin(PinRequest("t"), cached_blocks(pool, [b"d", b"e", b"f"]), 1.0)
    assert pins.stats.refused == 1 and not pins.holds("t")
    # The session's next turn replaces its pin: the first one's blocks are let go.
    assert pins.pin(PinRequest("s"), first + cached_blocks(pool, [b"g"]), 1.0)
    assert pins.num_pins == 1 and pins.num_blocks == 4
    assert [b.ref_cnt for b in first] == [2, 2, 2]  # the turn's, and one pin's
    pins.reuse("s")
    assert pins.stats.reused == 1 and pins.num_blocks == 0
    assert [b.ref_cnt for b in first] == [1, 1, 1]


def test_only_blocks_holding_a_cached_prefix_are_pinned():
    pool = BlockPool(11, enable_caching=True)
    pins = KVPins(pool, 1.0, predict=False, clock=Clock())
    blocks = cached_blocks(pool, [b"a"]) + pool.get_new_blocks(1)  # a partial tail: no hash
    assert pins.pin(PinRequest("s"), blocks, 1.0)
    assert pins.pinned_block_ids() == [blocks[0].block_id]


def test_ttls_are_predicted_per_tool_from_the_gaps_seen_bounded():
    estimator = ToolGapEstimator()
    assert MIN_PREDICTED_TTL_S <= estimator.predict("search") <= MAX_PREDICTED_TTL_S
    for gap in (2.0, 2.0, 2.0, 4.0):
        estimator.observe("search", gap)
    estimator.observe("compile", 50.0)
    assert estimator.predict("search") == pytest.approx(6.0)  # the slow gap, with margin
    assert estimator.predict("compile") == MAX_PREDICTED_TTL_S  # 75 s, bounded
    assert estimator.predict("unseen") == pytest.approx(MAX_PREDICTED_TTL_S)  # all tools'
    estimator.observe("tiny", 0.1)
    assert estimator.predict("tiny") == MIN_PREDICTED_TTL_S


def turn(key: str, tool: str = "", ttl: float | None = None, arrival: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=1)
    return Request("r", [1, 2, 3], params, arrival_time=arrival, pin=PinRequest(key, ttl, tool))


def test_continuum_predicts_from_observed_gaps_and_puts_a_pinned_sessions_turn_first():
    pool = BlockPool(11, enable_caching=True)
    pins = KVPins(pool, 1.0, predict=True, clock=Clock())
    first = turn("s")
    pins.turn_finished(first, RequestStatus.FINISHED_STOPPED, cached_blocks(pool, [b"a"]))
    assert first.timing.pin_ttl_s is not None  # predicted: no TTL was asked
    ended = pins._turn_ends["s"][0]
    second = turn("s", tool="search", arrival=ended + 3.0)
    assert pins.goes_first(second)  # its session's pin holds its prefix
    assert pins.estimator.predict("search") == pytest.approx(4.5)  # 3 s seen, with margin
    assert not pins.goes_first(turn("other"))
    fcfs = KVPins(pool, 1.0, predict=False, clock=Clock())
    plain = turn("s")
    fcfs.turn_finished(plain, RequestStatus.FINISHED_STOPPED, cached_blocks(pool, [b"b"]))
    assert plain.timing.pin_ttl_s is None and fcfs.num_pins == 0  # fcfs: asked TTLs only
    aborted = turn("t", ttl=5.0)
    pins.turn_finished(aborted, RequestStatus.FINISHED_ABORTED, cached_blocks(pool, [b"c"]))
    assert not pins.holds("t")


def test_a_pin_needs_a_key_and_a_positive_ttl():
    with pytest.raises(ValueError, match="session key"):
        PinRequest("")
    with pytest.raises(ValueError, match="ttl"):
        PinRequest("s", ttl_s=0)
