"""Role switching in `pdserve bench router-sim`: the app's balancer (the KV index actor's code,
deployments/cluster/role_balance.py) moving simulated engines between prefill and decode,
against fixed P:D splits of the same engines on the same requests.

The balancer weighs what real replicas report: each engine's load as it publishes it, with the
mean TTFT and TPOT of its requests that finished within the window (observed when they finish
on the simulated clock, not when they are routed). Its SLO targets come from the simulated
engines' timing model, as `bench latency` would calibrate them: a prefill replica's queue may
hold what it computes in half the TTFT target, a decode replica may run as many sequences as
keep a step within the TPOT target (with a fifth to spare).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from deployments.cluster.sla_autoscaling import RecentLatencies
from engine.core.kv_events import EngineLoad

if TYPE_CHECKING:
    from pdserve.bench.router_sim import RouterSimConfig
    from pdserve.bench.sim_workload import SimRequest


def role_spec(config: RouterSimConfig) -> dict[str, Any]:
    """The `role_switching` spec the simulated app runs with."""
    sequences = (config.slo_tpot_ms / 1e3 - config.step_s) / config.step_per_seq_s
    return {
        "ttft_s": config.slo_ttft_ms / 1e3,
        "tpot_s": config.slo_tpot_ms / 1e3,
        "queued_prompt_tokens": config.prefill_tokens_per_s * config.slo_ttft_ms / 1e3 / 2,
        "running_requests": max(1.0, 0.8 * sequences),
        "interval_s": config.role_interval_s,
        "max_step": config.role_max_step,
    }


class SimSignals:
    """Each engine's recent TTFT and TPOT means on the simulated clock; a request's figures
    count from when it finishes there."""

    def __init__(self, window_s: float) -> None:
        self.now = 0.0
        self._window_s = window_s
        self._latencies: dict[str, RecentLatencies] = {}
        self._due: list[tuple[float, int, str, float | None, float | None]] = []
        self._count = 0  # ties in time keep their order

    def later(
        self, at: float, engine: str, ttft_s: float | None = None, tpot_s: float | None = None
    ) -> None:
        self._count += 1
        heapq.heappush(self._due, (at, self._count, engine, ttft_s, tpot_s))

    def until(self, now: float) -> None:
        """Observe what finished by `now`."""
        due = self._due
        while due and due[0][0] <= now:
            at, _, engine, ttft, tpot = heapq.heappop(due)
            self.now = at
            self._of(engine).observe(ttft, tpot)
        self.now = now

    def with_means(self, engine: str, load: EngineLoad) -> EngineLoad:
        return self._of(engine).with_means(load)

    def _of(self, engine: str) -> RecentLatencies:
        latencies = self._latencies.get(engine)
        if latencies is None:
            latencies = RecentLatencies(self._window_s, clock=lambda: self.now)
            self._latencies[engine] = latencies
        return latencies


def compare_splits(
    config: RouterSimConfig, requests: list[SimRequest], configured: dict[str, Any] | None
) -> dict[str, Any]:
    """The kv policy over the same requests at each fixed split and with role switching
    (starting from the configured split): goodput and the SLO's two halves. `configured`:
    the kv policy's result at the configured split, if it ran (not run again)."""
    from pdserve.bench.router_sim import _Simulation

    total = config.prefill_replicas + config.decode_replicas
    splits = config.fixed_splits or (total // 4, total // 2, total - total // 4)
    fixed = {}
    for prefill in splits:
        if not 0 < prefill < total:
            raise ValueError(f"fixed_splits: each must be between 1 and {total - 1}")
        if configured is not None and prefill == config.prefill_replicas:
            result = configured
        else:
            result = _Simulation(config, "kv", prefill_replicas=prefill).run(requests)
        fixed[f"{prefill}:{total - prefill}"] = _brief(result)
    switching = _brief(_Simulation(config, "kv", switching=True).run(requests))
    best = max(f["goodput_per_s"] for f in fixed.values())
    return {
        "fixed": fixed,
        "switching": switching,
        "over_best_fixed": round(switching["goodput_per_s"] / best, 2) if best else None,
    }


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("goodput_per_s", "ttft_ms", "tpot_ms", "switches", "final_split")
    return {k: result[k] for k in keys if k in result}
