"""pdserve bench chaos: steady load on a local Serve app while its replicas are killed.

Loopback only, bounded in time and in requests. Clients send greedy requests whose answers are
known (offline generation on the same weights), cancel some streams part-way, and send some
malformed requests; every `kill_every_s` a replica of the next role in turn (prefill, decode,
router) is killed with SIGKILL: the one with the most requests in flight (ties at random), for
a kill of an idle replica would test nothing. Every request sent lands in exactly one outcome,
and the outcomes add up to the requests sent (`outcomes_add_up`):

- completed: exact (the offline tokens) or mismatched (must be 0);
- cancelled by the client, or malformed and refused (INVALID_ARGUMENT) or accepted (must be 0);
- failed with a clear error: a gRPC status whose message carries nothing of Ray's (a stream cut
  by its router replica's death is one: the request was in that process);
- failed unclearly: a message with actor ids, colour codes or a traceback, or any exception
  that is not a gRPC status (must be 0);
- timed out (the server's deadline) or lost: no answer by the client's own deadline, past the
  server's (must be 0).

The report counts the migrations the completed requests went through (each response's last
chunk says how many times its generation moved to another engine): with decode replicas
killed under load, some must have moved. With `kv_fault_rate`, that share of the engines' KV
reads gets a fault as it completes (connector/faults.py): a flipped bit, a lost tail or a
stale block — the live engines' checksum failures must equal those faults
(`kv_checksum_failures`, `kv_faults_injected`) — or a delayed or lost completion, or a remote
dying mid-read (`kv_faults_lost`, `kv_faults_died`: failed reads, recomputed); no completed
request may differ. The report also counts the reads failed, fenced and given up on.

Afterwards every engine must hold no block and no request (`blocks_held_after`), and the
engine replicas' resident memory is compared with what it was after the warm-up (growth for
the processes that lived through the run; a killed replica's replacement is a new process).
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.bench.chaos_outcomes import Tally, classify_rpc_error, outcomes, rpc_status

ROLES = ("prefill", "decode", "router")
_DEPLOYMENTS = {"prefill": "PrefillServer", "decode": "DecodeServer", "router": "Router"}


@dataclass
class ChaosConfig:
    model: str = "tiny"
    """the model the local app serves"""
    duration_s: float = 600.0
    """how long the load runs"""
    max_requests: int = 100_000
    """requests sent at most (the load stops at whichever comes first)"""
    concurrency: int = 6
    """requests in flight at once"""
    max_tokens: int = 48
    """output tokens a request asks for"""
    kill_every_s: float = 60.0
    """seconds between two kills (SIGKILL) of a replica, prefill, decode and router in turn"""
    cancel_fraction: float = 0.1
    """requests the client cancels part-way"""
    malformed_fraction: float = 0.05
    """requests sent malformed (each must be refused as INVALID_ARGUMENT)"""
    request_timeout_s: float = 60.0
    """the server's deadline for a request (the client waits longer)"""
    num_cpus: int = 8
    """Ray's logical CPUs"""
    decode_replicas: int = 2
    """decode replicas of the app"""
    router_replicas: int = 2
    """router replicas of the app"""
    engine_args: dict[str, Any] = field(
        default_factory=lambda: {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
    )
    """the engines' arguments (JSON)"""
    seed: int = 0
    """the load's random choices"""
    kv_fault_rate: float = 0.0
    """share of the engines' KV reads given a fault as they complete: a flipped bit, a lost
    tail or a stale block (each must be caught by its checksum), a delayed or lost
    completion, a remote dying mid-read (each failed read is recomputed)"""

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.max_requests < 1 or self.concurrency < 1:
            raise ValueError("duration_s, max_requests and concurrency must be positive")
        for name in ("cancel_fraction", "malformed_fraction"):
            if not 0 <= getattr(self, name) < 0.5:
                raise ValueError(f"{name} must be in [0, 0.5)")
        if not 0 <= self.kv_fault_rate <= 1:
            raise ValueError("kv_fault_rate must be in [0, 1]")


def run(config: ChaosConfig) -> dict[str, Any]:
    """Start a local app of the config's shape, run the chaos on it (`run_on`), stop it."""
    from deployments.app_config import AppConfig
    from deployments.launch import APP_NAME, ServeOptions, free_port, start, stop

    app = AppConfig.from_args(
        {
            "model": config.model,
            "engine_args": config.engine_args,
            "decode_replicas": config.decode_replicas,
            "router_replicas": config.router_replicas,
            "num_cpus_per_engine": 0.5,
            "request_timeout_s": config.request_timeout_s,
            "kv_fault_injection": _fault_injection(config),
        }
    )
    grpc_port = free_port()
    # Ray forwards its processes' output to this one's stdout, which carries the report.
    options = ServeOptions(grpc_port=grpc_port, http_port=free_port(), num_cpus=config.num_cpus)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            start(app, options)  # a failed start leaves no Ray behind either
            return run_on(config, f"127.0.0.1:{grpc_port}", APP_NAME)
        finally:
            stop()


def _fault_injection(config: ChaosConfig) -> dict[str, Any] | None:
    """The app's kv_fault_injection for `config.kv_fault_rate` (None: none)."""
    if not config.kv_fault_rate:
        return None
    return {"rate": config.kv_fault_rate, "seed": config.seed}


def run_on(config: ChaosConfig, target: str, app: str) -> dict[str, Any]:
    """The chaos on app `app` of the Serve that this process is connected to (its gRPC proxy at
    `target`), serving `config.model` with prefill, decode and router replicas: its replicas
    are found and killed through Ray, so the app must run on this machine. The requests
    carry their own deadline (`config.request_timeout_s`), whatever the app's default; the
    config's app shape (`decode_replicas`, `router_replicas`, `num_cpus`) is `run`'s, not
    read here, nor is `kv_fault_rate` (the app's kv_fault_injection sets it)."""
    prompts = [f"Chaos request {i} asks about" for i in range(24)]
    expected = _offline(config, prompts)
    return _chaos(config, target, app, prompts, expected)


def _offline(config: ChaosConfig, prompts: list[str]) -> list[list[int]]:
    from engine.llm import LLM
    from engine.request import SamplingParams

    llm = LLM(config.model, **config.engine_args)
    try:
        params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    finally:
        llm.close()


def _chaos(
    config: ChaosConfig, target: str, app: str, prompts: list[str], expected: list[list[int]]
) -> dict[str, Any]:
    from pdserve.client import GenerationClient

    client = GenerationClient(target, app)
    _warm_up(_Load(client, config, prompts, expected, Tally()))
    tally = Tally()
    load = _Load(client, config, prompts, expected, tally)
    rss_before = _engine_rss(app)
    stop_at = time.monotonic() + config.duration_s
    issued = _Issued(config.max_requests)
    kills: Counter[str] = Counter()
    killer = threading.Thread(target=_killer, args=(config, app, stop_at, kills), daemon=True)
    workers = [
        threading.Thread(
            target=_worker, args=(load, random.Random(config.seed + w), stop_at, issued)
        )
        for w in range(config.concurrency)
    ]
    began = time.monotonic()
    killer.start()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.monotonic() - began
    killer.join(timeout=5)
    idle_s, leftovers = _wait_idle(client, timeout_s=180)
    rss_after = _engine_rss(app)
    client.close()
    return {
        "config": asdict(config),
        "duration_s": round(elapsed, 1),
        **outcomes(tally, issued.count),
        "kills": dict(kills),
        "idle_after_s": idle_s,
        **leftovers,
        "engine_rss_mb": {"after_warmup": rss_before, "after": rss_after},
        # Processes alive at both samples (a killed replica's replacement is a new one).
        "engine_rss_growth_mb": {
            key: round(rss_after[key] - rss_before[key], 1)
            for key in rss_before.keys() & rss_after.keys()
        },
    }


class _Issued:
    """Requests issued so far, against the bound."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.count = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.count >= self.bound:
                return False
            self.count += 1
            return True


@dataclass
class _Load:
    """What every client thread shares: the endpoint, the prompts and their known answers."""

    client: Any
    config: ChaosConfig
    prompts: list[str]
    expected: list[list[int]]
    tally: Tally


def _warm_up(load: _Load) -> None:
    """Three plain requests before the clock starts: every engine has run, memory is what
    steady state holds. They must complete exactly (else the app is broken before any kill)."""
    for i in range(3):
        _one(load, random.Random(i), plain=True)
    if load.tally.counts["exact"] != 3:
        raise RuntimeError(f"the warm-up requests did not complete exactly: {load.tally}")


def _worker(load: _Load, rng: random.Random, stop_at: float, issued: _Issued) -> None:
    while time.monotonic() < stop_at and issued.take():
        _one(load, rng)


def _one(load: _Load, rng: random.Random, plain: bool = False) -> None:
    import grpc

    from pdserve.client import generate_request

    client, config, tally = load.client, load.config, load.tally
    prompts, expected = load.prompts, load.expected
    roll = rng.random()
    if not plain and roll < config.malformed_fraction:
        _malformed(client, rng, tally)
        return
    i = rng.randrange(len(prompts))
    request = generate_request(
        prompts[i],
        max_tokens=config.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        timeout_s=config.request_timeout_s,
    )
    cancel = not plain and roll < config.malformed_fraction + config.cancel_fraction
    client_deadline = config.request_timeout_s + 30
    try:
        call = client.stream(request, timeout=client_deadline)
        tokens: list[int] = []
        migrations = 0
        for n, chunk in enumerate(call):
            tokens.extend(chunk.token_ids)
            migrations = chunk.migrations  # set on the last chunk
            if cancel and n == 2:
                call.cancel()
                tally.add("cancelled")
                return
        tally.add("exact" if tokens == expected[i] else "mismatch", migrations=migrations)
    except grpc.RpcError as exc:
        classify_rpc_error(exc, tally, cancelled=cancel)
    except Exception as exc:  # anything else is counted too, never dropped
        tally.add("failed_unclear", f"{type(exc).__name__}: {exc}")


def _malformed(client: Any, rng: random.Random, tally: Tally) -> None:
    import grpc

    from pdserve.client import generate_request

    bad = rng.choice(
        [
            generate_request([1, 10**7], max_tokens=4),  # outside the vocabulary
            generate_request("", max_tokens=4),  # empty
            generate_request("Too long", max_tokens=10**6),  # past the context
            generate_request("Bad temperature", max_tokens=4, temperature=-1.0),
        ]
    )
    try:
        client.complete(bad, timeout=30)
        tally.add("accepted_malformed")
    except grpc.RpcError as exc:
        code, details = rpc_status(exc)
        clear = code == grpc.StatusCode.INVALID_ARGUMENT
        tally.add("refused" if clear else "failed_unclear", f"{code}: {details}")
    except Exception as exc:
        tally.add("failed_unclear", f"{type(exc).__name__}: {exc}")


def _killer(config: ChaosConfig, app: str, stop_at: float, kills: Counter[str]) -> None:
    """SIGKILL a replica of `app`, of the next role in turn, every `kill_every_s`."""
    turn = 0
    while time.monotonic() + config.kill_every_s < stop_at:
        time.sleep(config.kill_every_s)
        role = ROLES[turn % len(ROLES)]
        turn += 1
        if _kill_one(app, _DEPLOYMENTS[role], random.Random(turn)):
            kills[role] += 1


def _replicas(app: str, deployment: str) -> dict[str, int]:
    """Actor name -> pid of the live replicas of one deployment of `app` (not of other apps
    beside it)."""
    from ray._private import state

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {
        str(actor["Name"]): int(actor["Pid"])
        for actor in state.actors().values()
        if actor.get("State") == "ALIVE"
        and str(actor.get("Name", "")).startswith(prefix)
        and actor.get("Pid")
    }


def _replica_pids(app: str, deployment: str) -> list[int]:
    return list(_replicas(app, deployment).values())


def _ongoing(actor_names: list[str]) -> dict[str, int]:
    """Requests in flight on each replica that answers within 5 s, as Serve counts them (the
    replicas are asked at once; one dying or gone is left out)."""
    import ray

    refs: dict[Any, str] = {}
    for name in actor_names:
        with contextlib.suppress(Exception):
            actor = ray.get_actor(name, namespace="serve")
            refs[actor.get_num_ongoing_requests.remote()] = name
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=5)
    counts = {}
    for ref in ready:
        with contextlib.suppress(Exception):
            counts[refs[ref]] = int(ray.get(ref))
    return counts


_BUSY_WAIT_S = 5.0


def _kill_one(app: str, deployment: str, rng: random.Random) -> bool:
    import os
    import signal

    replicas = _replicas(app, deployment)
    if not replicas:
        return False
    # A kill is meant to land under load: a moment when no replica of the role holds a
    # request (the load recovering from the last kill) is waited out, up to a few seconds.
    deadline = time.monotonic() + _BUSY_WAIT_S
    while True:
        load = _ongoing(sorted(replicas)) or dict.fromkeys(replicas, 0)  # none answered: any
        busiest = max(load.values())
        if busiest > 0 or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    victim = rng.choice(sorted(name for name, n in load.items() if n == busiest))
    with contextlib.suppress(ProcessLookupError):
        os.kill(replicas[victim], signal.SIGKILL)
        print(f"bench chaos: killed a {deployment} replica", file=sys.stderr, flush=True)
        return True
    return False


def _engine_rss(app: str) -> dict[str, float]:
    """Resident MiB of each engine replica process of `app` now (by pid)."""
    import psutil

    rss = {}
    for deployment in ("PrefillServer", "DecodeServer"):
        for pid in _replica_pids(app, deployment):
            with contextlib.suppress(psutil.Error):
                rss[f"{deployment}:{pid}"] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    return rss


# The live engines' KV transfer counters (Health), summed: faults injected into their reads
# and what caught them — checksum failures (recomputed), failed, fenced, unanswered reads.
_KV_COUNTS = (
    "kv_faults_injected",
    "kv_checksum_failures",
    "kv_faults_lost",
    "kv_faults_died",
    "kv_reads_failed",
    "kv_fenced_reads",
    "kv_unanswered_reads",
    "kv_timed_out_reads",
)


def _wait_idle(client: Any, timeout_s: float) -> tuple[float | None, dict[str, int]]:
    """Seconds until every replica runs and holds nothing (None: not within `timeout_s`), and
    what the engines hold at that point; with the KV faults the live engines had injected into
    their reads and the checksum failures they found (a killed engine's counts go with it)."""
    began = time.monotonic()
    leftovers = {"blocks_held_after": -1, "requests_held_after": -1, "unreachable_after": -1}
    kv = dict.fromkeys(_KV_COUNTS, -1)
    while time.monotonic() - began < timeout_s:
        with contextlib.suppress(Exception):
            health = client.health()
            engines = health.engines
            leftovers = {
                "blocks_held_after": sum(e.num_blocks - e.num_free_blocks for e in engines),
                "requests_held_after": sum(
                    e.num_running + e.num_waiting + e.num_held_requests for e in engines
                ),
                "unreachable_after": sum(e.state != "running" for e in engines),
            }
            kv = {name: sum(getattr(e, name) for e in engines) for name in _KV_COUNTS}
            if health.status == "SERVING" and not any(leftovers.values()):
                return round(time.monotonic() - began, 1), {**leftovers, **kv}
        time.sleep(1.0)
    return None, {**leftovers, **kv}


CONFIG = ChaosConfig
