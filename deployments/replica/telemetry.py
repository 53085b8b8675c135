"""An engine replica's telemetry: its part of each request's trace, built after the fact from
the engine's RequestTiming (wall-clock moments taken in the engine loop thread, so the spans
carry explicit start and end times), and its metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from deployments.metrics import ReplicaMetrics, each
from deployments.telemetry import LATENCY_BUCKETS_S, extract_context, set_error
from engine.request import RequestTiming
from engine.spec_decode.ngram import SpecDecodeStats

if TYPE_CHECKING:
    from engine.stats import EngineStats

_NS = 1_000_000_000


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


def record_engine_spans(
    tracer: Tracer,
    role: str,
    carrier: Mapping[str, str] | None,
    timing: RequestTiming,
    attributes: dict[str, Any],
    error: str | None = None,
    kv: dict[str, Any] | None = None,
) -> None:
    """The engine's part of a request's trace, from its timing: `prefill` or `decode` (the
    colocated engine's is `engine`), and under a decode span the `kv_transfer` it waited for."""
    parent = extract_context(carrier)
    if parent is None or timing.finished is None:
        return
    name = {"prefill": "prefill", "decode": "decode"}.get(role, "engine")
    span = tracer.start_span(
        name, context=parent, kind=SpanKind.INTERNAL, start_time=_ns(timing.arrival)
    )
    span.set_attributes({**attributes, **_phase_attributes(timing)})
    if error is not None:
        set_error(span, error)
    if timing.kv_load_start is not None and timing.kv_load_end is not None:
        _record_kv_transfer(tracer, span, timing, kv or {})
    span.end(end_time=_ns(timing.finished))


def _phase_attributes(timing: RequestTiming) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    ready = timing.kv_load_end or timing.arrival  # a decode waits for its KV, then queues
    if timing.first_scheduled is not None:
        attributes["pdserve.queue_time_s"] = max(0.0, timing.first_scheduled - ready)
        if timing.finished is not None:
            attributes["pdserve.compute_time_s"] = timing.finished - timing.first_scheduled
    if timing.first_token is not None:
        attributes["pdserve.time_to_first_token_s"] = timing.first_token - timing.arrival
    return attributes


def _record_kv_transfer(
    tracer: Tracer, parent: Span, timing: RequestTiming, kv: dict[str, Any]
) -> None:
    assert timing.kv_load_start is not None and timing.kv_load_end is not None
    span = tracer.start_span(
        "kv_transfer",
        context=trace.set_span_in_context(parent),
        kind=SpanKind.CLIENT,
        start_time=_ns(timing.kv_load_start),
    )
    outcome = timing.kv_load_outcome or "ok"
    if timing.kv_load_tier is not None:  # from this engine's own tier, not another engine
        span.set_attribute("pdserve.kv.tier", timing.kv_load_tier)
    span.set_attributes(
        {
            "pdserve.kv.transport": kv.get("transport", ""),
            "pdserve.kv.blocks": timing.kv_load_blocks,
            "pdserve.kv.bytes": timing.kv_load_blocks * int(kv.get("block_bytes", 0)),
            "pdserve.kv.descriptors": timing.kv_load_descriptors,
            "pdserve.kv.duration_s": timing.kv_load_end - timing.kv_load_start,
            "pdserve.kv.outcome": outcome,
        }
    )
    if timing.kv_load_adopted_first_token:  # the decode engine computed no prompt token
        span.set_attribute("pdserve.kv.first_token_adopted", True)
    if timing.kv_load_problem is not None:  # why not all of it was used, in a word
        span.set_attribute("pdserve.kv.problem", timing.kv_load_problem)
    if outcome != "ok":
        set_error(span, f"KV transfer {outcome}")
    span.end(end_time=_ns(timing.kv_load_end))


def _pin_counter(make: ReplicaMetrics) -> Any:
    return make.counter(
        "pdserve_kv_pins",
        "Finished turns' KV pins: made, refused over the budget, reused by the session's "
        "next turn, replaced by its next pin, expired, moved down to the tier under "
        "pressure, or (no tier) given way to a waiting request with nothing running",
        ("outcome",),
        each("outcome", PIN_OUTCOMES),
    )


def _checksum_seconds(make: ReplicaMetrics) -> Any:
    return make.counter(
        "pdserve_kv_checksum_seconds",
        "Time spent summing KV blocks: those handed out or lent (side=produced), those read, "
        "to check them (side=verified)",
        ("side",),
        each("side", ("produced", "verified")),
    )


def _tier_counters(make: ReplicaMetrics, tier: str) -> tuple[Any, Any, Any]:
    """The KV tier's counters (engine/offload/), their series at 0 from start-up where the
    engine has a tier."""
    blocks = make.counter(
        "pdserve_kv_tier_blocks",
        "KV blocks the engine's tier below its pool took in (op=stored), gave back verified "
        "(loaded; swapped_in: a preempted request's own; lent: copied back for a prefix "
        "loan), failed to give back (failed: recomputed), moved from host memory to disk "
        "(demoted) or dropped for room (evicted)",
        ("tier", "op"),
        [{"tier": tier, "op": op} for op in TIER_OPS] if tier else [],
    )
    hit_tokens = make.counter(
        "pdserve_kv_tier_hit_tokens",
        "Prompt tokens found in the engine's KV tier past its pool's hits",
        ("tier",),
        each("tier", [tier] if tier else []),
    )
    preemptions = make.counter(
        "pdserve_kv_tier_preemptions",
        "Preempted requests whose KV went down to the tier to come back (choice=swap) or was "
        "dropped to be computed again (recompute), as measured costs decided",
        ("tier", "choice"),
        [{"tier": tier, "choice": c} for c in PREEMPTION_CHOICES] if tier else [],
    )
    return blocks, hit_tokens, preemptions


def _spec_decode_counters(make: ReplicaMetrics) -> dict[str, Any]:
    return {
        field: make.counter(f"pdserve_spec_decode_{field}", help_text)
        for field, help_text in (
            ("num_drafts", "Verification steps of requests with drafts"),
            ("num_draft_tokens", "Draft tokens verified"),
            ("num_accepted_tokens", "Draft tokens accepted"),
        )
    }


def _kv_check_counters(make: ReplicaMetrics) -> dict[str, Any]:
    """What the reader's checks found in the KV it read (engine/block_checksums.py), by the
    connector counter each follows: blocks that matched their producer's checksum, blocks that
    did not (never used: recomputed or failed by kv_load_failure_policy), and the reads they
    were in; reads fenced (the lease had ended), given up on (connector/read_watch.py) or
    timed out; and, on the producing side, leases that expired unreleased.
    (The names are written out: the dashboard's test finds them in this file.)"""
    return {
        "blocks_verified": make.counter(
            "pdserve_kv_blocks_verified", "KV blocks read that matched their checksum"
        ),
        "blocks_corrupted": make.counter(
            "pdserve_kv_blocks_corrupted", "KV blocks read that failed their checksum"
        ),
        "checksum_failures": make.counter(
            "pdserve_kv_checksum_failures", "KV reads with a block that failed its checksum"
        ),
        "fenced_reads": make.counter(
            "pdserve_kv_fenced_reads", "KV reads whose remote no longer held the blocks"
        ),
        "unanswered_reads": make.counter(
            "pdserve_kv_unanswered_reads", "KV reads given up on: the remote stopped answering"
        ),
        "timed_out_reads": make.counter(
            "pdserve_kv_timed_out_reads", "KV reads not reported done by their deadline"
        ),
        "leases_expired": make.counter(
            "pdserve_kv_leases_expired",
            "KV leases that ran out before their reader released them (it never came, or late)",
        ),
    }


# How a KV load that was not simply "ok" ended (engine/core/kv_transfer_state.py).
KV_LOAD_FAILURES = ("recovered", "failed")
# The KV tier's block counters (engine/offload/tier_index.py TierStats), by op.
TIER_OPS = ("stored", "loaded", "swapped_in", "lent", "failed", "demoted", "evicted")
PREEMPTION_CHOICES = ("swap", "recompute")
# What became of finished turns' pins (engine/core/pins.py PinStats).
PIN_OUTCOMES = ("pinned", "refused", "reused", "replaced", "expired", "moved_down", "gave_way")


class EngineMetrics:
    """An engine replica's metrics: queues, KV cache, prefix cache, preemptions, transfers.
    `transport`: the engine's KV transport ("nixl", "grpc"; "" without KV transfer), whose
    series exist from start-up."""

    def __init__(
        self, transport: str = "", make: ReplicaMetrics | None = None, tier: str = ""
    ) -> None:
        make = make or ReplicaMetrics()
        transports = each("transport", [transport] if transport else [])
        self.tier = tier
        self.tier_blocks, self.tier_hit_tokens, self.tier_preemptions = _tier_counters(make, tier)
        self.pins = _pin_counter(make)
        self.running = make.gauge("pdserve_running_requests", "Requests running")
        self.waiting = make.gauge("pdserve_waiting_requests", "Requests waiting")
        self.kv_usage = make.gauge("pdserve_kv_cache_usage", "Fraction of KV blocks in use")
        self.prefix_hit_rate = make.gauge(
            "pdserve_prefix_cache_hit_rate", "Prefix-cache hit rate (tokens) since last sample"
        )
        self.prefix_queries = make.counter(
            "pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = make.counter(
            "pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.preemptions = make.counter("pdserve_preemptions", "Requests preempted")
        self.kv_bytes = make.counter(
            "pdserve_kv_transfer_bytes",
            "KV bytes read from prefill engines",
            ("transport",),
            transports,
        )
        self.kv_descriptors = make.counter(
            "pdserve_kv_transfer_descriptors",
            "Runs of consecutive KV blocks read from prefill engines (NIXL's descriptors)",
            ("transport",),
            transports,
        )
        self.kv_seconds = make.histogram(
            "pdserve_kv_transfer_seconds",
            "KV transfer duration",
            LATENCY_BUCKETS_S,
            ("transport",),
        )
        self.kv_failures = make.counter(
            "pdserve_kv_transfer_failures",
            "KV transfers that failed",
            ("transport", "outcome"),
            [{**t, "outcome": o} for t in transports for o in KV_LOAD_FAILURES],
        )
        self.kv_counters = _kv_check_counters(make)
        self.kv_checksum_seconds = _checksum_seconds(make)
        # Speculative decoding (vLLM's spec_decode counters): acceptance rate = accepted / draft
        # tokens, mean accepted length = 1 + accepted / drafts.
        self.spec_counters = _spec_decode_counters(make)
        self.spec_acceptance = make.gauge(
            "pdserve_spec_decode_acceptance_rate", "Accepted / draft tokens since the engine began"
        )
        self.tp_collective_seconds = make.counter(
            "pdserve_tp_collective_seconds",
            "Rank 0's time in tensor-parallel all-reduce and all-gather (exchanging, and "
            "waiting for the slower ranks)",
        )
        self._seen: EngineStats | None = None  # the last sample's reading

    def sample(self, stats: EngineStats) -> None:
        """Periodic: gauges from the engine's latest stats, counters from the deltas since the
        last sample (Ray's counters refuse an increment of 0: only positive ones are added)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        seen = self._seen
        queries = stats.prefix_cache_queries - (seen.prefix_cache_queries if seen else 0)
        if queries > 0:
            hits = stats.prefix_cache_hits - (seen.prefix_cache_hits if seen else 0)
            self.prefix_queries.inc(queries)
            if hits > 0:
                self.prefix_hits.inc(hits)
            self.prefix_hit_rate.set(hits / queries)
        preemptions = stats.num_preemptions - (seen.num_preemptions if seen else 0)
        if preemptions > 0:
            self.preemptions.inc(preemptions)
        spec, spec_seen = stats.spec_decode, seen.spec_decode if seen else SpecDecodeStats()
        if spec.num_drafts > spec_seen.num_drafts:
            for field, counter in self.spec_counters.items():
                delta = getattr(spec, field) - getattr(spec_seen, field)
                if delta > 0:
                    counter.inc(delta)
            self.spec_acceptance.set(spec.acceptance_rate)
        kv_seen = seen.kv_transfer if seen else {}

        def kv_delta(field: str) -> int:
            return stats.kv_transfer.get(field, 0) - kv_seen.get(field, 0)

        for field, counter in self.kv_counters.items():
            if (delta := kv_delta(field)) > 0:
                counter.inc(delta)
        for side in ("produced", "verified"):
            if (micros := kv_delta(f"checksum_us_{side}")) > 0:
                self.kv_checksum_seconds.inc(micros / 1e6, {"side": side})
        if (micros := stats.tp_collective_us - (seen.tp_collective_us if seen else 0)) > 0:
            self.tp_collective_seconds.inc(micros / 1e6)
        if self.tier:
            self._sample_tier(stats.kv_tier, seen.kv_tier if seen else {})
        pins_seen = seen.kv_pins if seen else {}
        for outcome in PIN_OUTCOMES:
            if (delta := stats.kv_pins.get(outcome, 0) - pins_seen.get(outcome, 0)) > 0:
                self.pins.inc(delta, {"outcome": outcome})
        self._seen = stats

    def _sample_tier(self, now: dict[str, int], seen: dict[str, int]) -> None:
        for op in TIER_OPS:
            if (delta := now.get(op, 0) - seen.get(op, 0)) > 0:
                self.tier_blocks.inc(delta, {"tier": self.tier, "op": op})
        if (delta := now.get("hit_tokens", 0) - seen.get("hit_tokens", 0)) > 0:
            self.tier_hit_tokens.inc(delta, {"tier": self.tier})
        for choice in PREEMPTION_CHOICES:
            field = f"{choice}_preemptions"
            if (delta := now.get(field, 0) - seen.get(field, 0)) > 0:
                self.tier_preemptions.inc(delta, {"tier": self.tier, "choice": choice})

    def observe_transfer(self, timing: RequestTiming, transport: str, block_bytes: int) -> None:
        if timing.kv_load_start is None or timing.kv_load_end is None:
            return
        if timing.kv_load_tier is not None:
            return  # this engine's own tier: counted by pdserve_kv_tier_blocks
        tags = {"transport": transport}
        self.kv_seconds.observe(timing.kv_load_end - timing.kv_load_start, tags)
        if timing.kv_load_blocks and block_bytes:
            self.kv_bytes.inc(timing.kv_load_blocks * block_bytes, tags)
        if timing.kv_load_descriptors:
            self.kv_descriptors.inc(timing.kv_load_descriptors, tags)
        if timing.kv_load_outcome not in (None, "ok"):
            self.kv_failures.inc(1, {**tags, "outcome": str(timing.kv_load_outcome)})
