"""`pdserve bench router-sim`: the real routing code at cluster scale on a simulated clock.

The app's KV index (`KVIndexServer`, the actor's class, called in this process), the cache
survey, cache-aware disaggregation and the cost ranking (deployments/cluster/) route every
request of a trace (Mooncake's format) or of a synthetic multi-turn workload over simulated
prefill and decode engines (pdserve/bench/sim_engine.py): prefix caches with LRU eviction
that publish their KV events in numbered batches every 20 ms of simulated time, as real
engines do, and a timing model. Each policy routes the same requests over fresh engines:
- `kv`: pdserve's (as the Router and both legs' request routers do it);
- `round_robin`;
- `dynamo`: Dynamo's published KV-router cost, overlap weight x blocks to prefill + blocks
  active on the worker, the least taken.

Reported per policy: the wall time of the routing code per request (what a router spends;
the actor call around a lookup, ~1 ms in a deployment, is not simulated), prefix hit rate
against an oracle with unlimited cache (every block ever computed anywhere), TTFT / TPOT and
goodput under an SLO on the simulated clock; and the index's size per (hash, replica) entry.
With `--role-switching`, the kv policy also runs at fixed P:D splits and with the app's role
balancer moving engines between the roles (pdserve/bench/sim_roles.py); `--workload phases`
is a load that shifts between prefill-heavy and decode-heavy phases.
"""

from __future__ import annotations

import heapq
import pickle
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from deployments.cluster import cost_search
from deployments.cluster.kv_index import KVIndexServer
from deployments.cluster.kv_scoring import (
    Holding,
    Holdings,
    decode_holder,
    lender_worth_borrowing,
    rank_by_cost,
    survey,
)
from pdserve.bench.index import built_index
from pdserve.bench.sim_engine import EngineModel, SimEngine, leading_run
from pdserve.bench.sim_roles import SimSignals, compare_splits, role_spec
from pdserve.bench.sim_workload import SimRequest, sim_requests
from pdserve.bench.stats import summarize
from pdserve.flags import Flag, int_list, str_list

T = TypeVar("T")

POLICIES = ("kv", "round_robin", "dynamo")


@dataclass(frozen=True)
class RouterSimConfig:
    prefill_replicas: int = 64
    """simulated prefill engines"""
    decode_replicas: int = 64
    """simulated decode engines"""
    policies: tuple[str, ...] = POLICIES
    """routing policies compared, comma-separated: kv, round_robin, dynamo"""
    trace: str | None = None
    """a Mooncake-format trace (none: synthetic multi-turn conversations)"""
    num_requests: int = 4000
    """requests routed (the trace's first ones)"""
    request_rate: float = 1000.0
    """arrivals per second on the simulated clock (a trace's clock is scaled to it)"""
    block_size: int = 16
    """tokens per KV block (a trace's 512-token blocks are 512 / 16 of them)"""
    max_prompt_blocks: int = 512
    """a prompt's blocks at most (longer ones are cut)"""
    prefill_tokens_per_s: float = EngineModel.prefill_tokens_per_s
    """a simulated engine's prefill rate"""
    step_s: float = EngineModel.step_s
    """a decode step of one sequence"""
    step_per_seq_s: float = EngineModel.step_per_seq_s
    """what each further sequence adds to a decode step"""
    capacity_blocks: int = EngineModel.capacity_blocks
    """each engine's KV blocks"""
    max_local_prefill_tokens: int = 128
    """cache-aware disaggregation (kv): a decode replica holding all but this many tokens
    computes the prompt itself"""
    min_loan_tokens: int = 64
    """prefix loans (kv): the prefill replica borrows a prompt's blocks from the engine
    holding the most when that spares it at least this many tokens"""
    slo_ttft_ms: float = 2000.0
    """goodput counts requests whose TTFT is within this"""
    slo_tpot_ms: float = 100.0
    """and whose time per output token is within this"""
    seed: int = 0
    """the workload's and the tie-breaks' random draws"""
    workload: str = "conversations"
    """without a trace: conversations (multi-turn, behind shared system prompts) or phases
    (alternately prefill-heavy and decode-heavy)"""
    phases: int = 4
    """phases of the phases workload, each num_requests / phases long"""
    phase_prompt_tokens: int = 2048
    """a prefill-heavy phase's prompts (a decode-heavy one's are a sixteenth of it)"""
    phase_output_tokens: int = 128
    """a decode-heavy phase's answers (a prefill-heavy one's are 16 tokens)"""
    role_switching: bool = False
    """also run the kv policy at fixed P:D splits and with engines switching roles"""
    fixed_splits: tuple[int, ...] = ()
    """prefill replicas of each fixed split compared, comma-separated (none: a quarter, half
    and three quarters of all replicas)"""
    role_interval_s: float = 1.0
    """the role balancer's decision interval, simulated seconds"""
    role_max_step: float = 0.5
    """the most of a role's replicas one decision moves"""

    def __post_init__(self) -> None:
        unknown = set(self.policies) - set(POLICIES)
        if unknown or not self.policies:
            raise ValueError(f"policies must be among {POLICIES}, got {list(self.policies)}")
        for name in ("prefill_replicas", "decode_replicas", "num_requests", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.request_rate <= 0:
            raise ValueError("request_rate must be > 0")
        if self.workload not in ("conversations", "phases"):
            raise ValueError(f"workload must be conversations or phases, got {self.workload!r}")


def run(config: RouterSimConfig) -> dict[str, Any]:
    requests = sim_requests(config)
    report: dict[str, Any] = {"benchmark": "router-sim", "config": asdict(config)}
    report["workload"] = {
        "requests": len(requests),
        "mean_prompt_blocks": round(sum(len(r.hashes) for r in requests) / len(requests), 1),
        "simulated_s": round(requests[-1].at_s, 3),
    }
    report["oracle_hit_rate"] = round(_oracle_hit_rate(requests), 4)
    report["policies"] = {}
    for policy in config.policies:
        report["policies"][policy] = _Simulation(config, policy).run(requests)
        hit = report["policies"][policy]["hit_rate"]
        report["policies"][policy]["hit_rate_of_oracle"] = (
            round(hit / report["oracle_hit_rate"], 3) if report["oracle_hit_rate"] else None
        )
    if config.role_switching:
        configured = report["policies"].get("kv")
        report["role_switching"] = compare_splits(config, requests, configured)
    return report


def _oracle_hit_rate(requests: list[SimRequest]) -> float:
    """With unlimited cache anywhere: each prompt's leading run of blocks computed before."""
    seen: set[bytes] = set()
    hits = total = 0
    for request in requests:
        hits += leading_run(request.hashes, seen)
        total += len(request.hashes)
        seen.update(request.hashes)
    return hits / max(1, total)


class _Simulation:
    def __init__(
        self,
        config: RouterSimConfig,
        policy: str,
        prefill_replicas: int | None = None,
        switching: bool = False,
    ) -> None:
        """`prefill_replicas`: of all the replicas, those starting as prefill (default: the
        config's split); `switching`: the app's role balancer moves them."""
        self.config, self.policy = config, policy
        model = EngineModel(
            config.prefill_tokens_per_s,
            config.step_s,
            config.step_per_seq_s,
            config.capacity_blocks,
        )
        total = config.prefill_replicas + config.decode_replicas
        num_prefill = config.prefill_replicas if prefill_replicas is None else prefill_replicas
        engines = [
            SimEngine(f"p{i}", "prefill", model, config.block_size) for i in range(num_prefill)
        ] + [
            SimEngine(f"d{i}", "decode", model, config.block_size)
            for i in range(total - num_prefill)
        ]
        self.engines = {e.name: e for e in engines}
        self._members = self._by_role()
        self._spec = role_spec(config) if switching else None
        self.signals = SimSignals(5 * config.role_interval_s) if switching else None
        self.switches = 0
        self.index = KVIndexServer()
        cost_search.native()  # built before the clock runs (a router warms it up as it starts)
        for engine in self.engines.values():
            self._announce(engine, engine.load(0.0))
        self.rng = random.Random(config.seed)
        self._turn = {"prefill": 0, "decode": 0}
        # What the router itself knows of what it sent: per replica, its requests in flight
        # (Serve's queue lengths, which the kv policy's ranking takes) and their blocks
        # (dynamo's active blocks); `_ends` says when each leaves.
        self._inflight: dict[str, int] = dict.fromkeys(self.engines, 0)
        self._active: dict[str, int] = dict.fromkeys(self.engines, 0)
        self._ends: list[tuple[float, str, int]] = []
        self._loads: dict[str, Any] = {}  # each engine's load as last published
        self.events = 0  # KV events published (one per engine step's stores or evictions)
        self.event_blocks = 0  # the block hashes they carry (what per-block counts count)
        # The kv policy's decision time by part: the index lookup, the Router's survey, both
        # legs' rankings (requests sent to a decode replica's cache alone have none).
        self.parts_us: dict[str, list[float]] = {"lookup": [], "survey": [], "rankings": []}

    def _by_role(self) -> dict[str, list[str]]:
        roles: dict[str, list[str]] = {"prefill": [], "decode": []}
        for engine in self.engines.values():
            roles[engine.role].append(engine.name)
        return roles

    def _announce(self, engine: SimEngine, load: Any, now: float = 0.0) -> None:
        """A (re)announcement, as the publisher's snapshot: its cache, role and load."""
        snapshot, name = _as_sent(engine.snapshot()), engine.name
        self.index.load_snapshot(name, snapshot, engine.role, load, name, self._spec, now)

    def run(self, requests: list[SimRequest]) -> dict[str, Any]:
        # Every engine publishes each `period`, on its own clock as the engines' publishers
        # do (not in step): engine i at i/N of the period (N engines), one at each tick.
        names = list(self.engines)
        tick_s, ticks = 0.02 / len(names), 0
        decisions_us, ttft_s, tpot_s, hits, blocks = [], [], [], 0, 0
        cached_routes = 0
        for request in requests:
            while (ticks + 1) * tick_s <= request.at_s:
                ticks += 1
                self._publish(names[ticks % len(names)], ticks * tick_s)
            self._leave(request.at_s)
            # The hashes as the index actor gets them: unpickled from the lookup's call (whose
            # time is not simulated), not the objects the workload made seconds before.
            sent = _as_sent(request.hashes)
            start = time.perf_counter()
            prefill, decode, lent = self._route(request, sent)
            decisions_us.append((time.perf_counter() - start) * 1e6)
            ttft, tpot, held = self._serve(request, prefill, decode, lent)
            prefilled = request.at_s + ttft
            ended = prefilled + tpot * request.output_len
            self._sent(prefill, prefilled, len(request.hashes))
            self._sent(decode, ended, len(request.hashes))
            if self.signals is not None:
                self.signals.later(prefilled, prefill or decode, ttft_s=ttft)
                self.signals.later(ended, decode, tpot_s=tpot if request.output_len > 1 else None)
            ttft_s.append(ttft)
            tpot_s.append(tpot)
            hits += held
            blocks += len(request.hashes)
            cached_routes += prefill is None
        good = sum(
            1
            for a, b in zip(ttft_s, tpot_s, strict=True)
            if a * 1e3 <= self.config.slo_ttft_ms and b * 1e3 <= self.config.slo_tpot_ms
        )
        duration = max(requests[-1].at_s, 1e-9)
        return {
            "decision_us": summarize(decisions_us, (0.5, 0.99)),
            **self._parts_report(),
            "hit_rate": round(hits / max(1, blocks), 4),
            "decode_only_routes": cached_routes,
            "ttft_ms": summarize([t * 1e3 for t in ttft_s], (0.5, 0.99)),
            "tpot_ms": summarize([t * 1e3 for t in tpot_s], (0.5, 0.99)),
            "goodput_per_s": round(good / duration, 1),
            "kv_events_per_s": round(self.events / duration),
            "kv_event_blocks_per_s": round(self.event_blocks / duration),
            **self._index_size(),
            **self._roles_report(),
        }

    def _parts_report(self) -> dict[str, Any]:
        if not self.parts_us["lookup"]:
            return {}
        parts = {k: summarize(v, (0.5, 0.99)) for k, v in self.parts_us.items() if v}
        return {"decision_parts_us": parts}

    def _roles_report(self) -> dict[str, Any]:
        if self.signals is None:
            return {}
        members = self._members
        return {
            "switches": self.switches,
            "final_split": f"{len(members['prefill'])}:{len(members['decode'])}",
        }

    def _publish(self, name: str, now: float) -> None:
        """The engine's batch since its last round and its load, when either changed, to the
        index (as its KVEventPublisher sends them)."""
        if self.signals is not None:
            self.signals.until(now)
        engine = self.engines[name]
        batch = engine.take_batch()
        load = engine.load(now)
        if self.signals is not None:
            load = self.signals.with_means(name, load)
        last = self._loads.get(name)
        if batch is not None or (load is not last and load != last):
            self._loads[name] = load
            if batch is not None:
                self.events += len(batch.events)
                self.event_blocks += sum(len(getattr(e, "block_hashes", ())) for e in batch.events)
            batches = [batch] if batch is not None else []
            reply = self.index.publish(name, _as_sent(batches), load, now=now)
            if reply.switch_to and reply.switch_to != engine.role:
                self._switch(engine, reply.switch_to, load, now)

    def _switch(self, engine: SimEngine, role: str, load: Any, now: float) -> None:
        """As an engine replica does when the index orders it: take the role and announce it;
        its requests of the old role run on (they drain)."""
        engine.role = role
        self._announce(engine, load, now)
        self._members = self._by_role()
        self.switches += 1

    # ------------------------------------------------------------------ routing

    def _route(self, request: SimRequest, sent: list[bytes]) -> tuple[str | None, str, int]:
        """(prefill replica or None for decode-only, decode replica, blocks a loan gives the
        prefill replica)."""
        if self.policy == "round_robin":
            return self._next("prefill"), self._next("decode"), 0
        if self.policy == "dynamo":
            return self._dynamo(request, sent, "prefill"), self._dynamo(request, sent, "decode"), 0
        return self._kv(request, sent)

    def _kv(self, request: SimRequest, sent: list[bytes]) -> tuple[str | None, str, int]:
        """As the Router (survey, cache-aware disaggregation, a prefix loan worth taking) and
        each leg's request router (its role's holdings, ranked by cost) do it; the wall time
        of each part goes to `parts_us`."""
        bs, tokens = self.config.block_size, request.prompt_tokens
        start = time.perf_counter()
        holdings = self.index.lookup(sent)
        looked_up = time.perf_counter()
        found = survey(holdings, request.hashes, tokens, bs)
        hint = decode_holder(found, tokens, self.config.max_local_prefill_tokens)
        surveyed_at = time.perf_counter()
        self.parts_us["lookup"].append((looked_up - start) * 1e6)
        self.parts_us["survey"].append((surveyed_at - looked_up) * 1e6)
        if hint:
            return None, hint, 0
        lender = lender_worth_borrowing(found, self.config.min_loan_tokens)
        surveyed = found.holdings  # each leg's router ranks by the survey's (EngineRequest)
        lent = lender.tokens // bs if lender is not None else 0  # as PrefixBorrower borrows
        prefill = self._ranked(request, "prefill", surveyed, lent)
        decode = self._ranked(request, "decode", surveyed)
        self.parts_us["rankings"].append((time.perf_counter() - surveyed_at) * 1e6)
        return prefill, decode, lent

    def _ranked(
        self, request: SimRequest, role: str, holdings: Mapping[str, Holding], lent: int = 0
    ) -> str:
        """As the leg's KVAwareRouter ranks (a loan's `lent` blocks count on every one)."""
        names = self._members[role]
        bs = self.config.block_size
        tokens = request.prompt_tokens
        ranks = rank_by_cost(names, holdings, tokens, bs, self._inflight, lent_blocks=lent)
        # (None: the cache says nothing; Serve's power of two choices)
        first = self._two_of(names) if ranks is None else ranks[0]
        if len(first) == 1:
            return first[0]
        # Serve's choice by queue length, stood in for by the loads reported (every replica's
        # is in `replicas`: a holder's Holding would be made for its load alone).
        loads = holdings.replicas if isinstance(holdings, Holdings) else holdings
        return min(first, key=lambda n: _busy(loads.get(n)))

    def _two_of(self, names: list[str]) -> list[str]:
        """Two of `names` at random, as `random.sample(names, 2)` chooses them (its Python
        took a fifth of a ranking here; this is Serve's choice, not the router's)."""
        if len(names) < 2:
            return names
        first = self.rng.randrange(len(names))
        second = self.rng.randrange(len(names) - 1)
        return [names[first], names[second + (second >= first)]]

    def _dynamo(self, request: SimRequest, sent: list[bytes], role: str) -> str:
        """Dynamo's KV router: overlap weight (1, its default) x blocks to prefill + blocks
        active on the worker once this request is there, the least taken; it counts active
        blocks itself, from the requests it routed (not from the engines' reports)."""
        holdings = self.index.lookup(sent, role)
        blocks = len(request.hashes)
        active = self._active

        def cost(name: str) -> float:
            holding = holdings.get(name)
            overlap = holding.cached_blocks if holding is not None else 0
            return 1.0 * (blocks - overlap) + active[name] + blocks

        return min(holdings, key=cost)

    def _sent(self, name: str | None, end: float, blocks: int) -> None:
        """A request was sent to `name` and runs there until `end`."""
        if name is not None:
            self._inflight[name] += 1
            self._active[name] += blocks
            heapq.heappush(self._ends, (end, name, blocks))

    def _leave(self, now: float) -> None:
        """The requests that ended by `now` leave the router's counts."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            _, name, blocks = heapq.heappop(ends)
            self._inflight[name] -= 1
            self._active[name] -= blocks

    def _next(self, role: str) -> str:
        names = self._members[role]
        turn = self._turn[role]
        self._turn[role] = turn + 1
        return names[turn % len(names)]

    # ------------------------------------------------------------------ serving

    def _serve(
        self, request: SimRequest, prefill: str | None, decode: str, lent: int
    ) -> tuple[float, float, int]:
        """Serve it on the simulated engines: (TTFT, TPOT, blocks the computing engine held
        or borrowed)."""
        bs, now = self.config.block_size, request.at_s
        decoder = self.engines[decode]
        computer = decoder if prefill is None else self.engines[prefill]
        held = max(computer.store(request.hashes), lent)
        done = computer.prefill(now, max(1, request.prompt_tokens - held * bs))
        if prefill is not None:
            decoder.store(request.hashes)  # the KV it read from the prefill engine
        tpot = decoder.decode(now, done, request.output_len, len(request.hashes))
        return done - now, tpot, held

    def _index_size(self) -> dict[str, Any]:
        """The index's entries, and its bytes per entry, rebuilt alone from the engines'
        caches (measuring it during the run would slow every lookup)."""
        index, size = built_index({e.name: e.cached() for e in self.engines.values()})
        entries = index.num_entries()
        return {"index_entries": entries, "index_bytes_per_entry": round(size / max(1, entries), 1)}


def _as_sent(message: T) -> T:
    """`message` as the index actor gets it from an engine (pickled and back: the index keeps
    copies of the engines' hashes, not the objects a router looks up with, as in the app,
    where a lookup compares their bytes)."""
    return pickle.loads(pickle.dumps(message))


def _busy(holding: Any) -> int:
    load = holding.load if holding is not None else None
    return (load.num_running + load.num_waiting) if load is not None else 0


CONFIG = RouterSimConfig
FLAGS = {"policies": Flag(parse=str_list), "fixed_splits": Flag(parse=int_list)}
