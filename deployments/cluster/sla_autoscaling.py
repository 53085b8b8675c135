"""P/D-aware autoscaling against SLO targets, on Ray Serve's custom autoscaling policy API.

Serve's default policy scales on ongoing requests, which says nothing of what users feel: a
prefill replica is short when time to first token grows or prompts queue up; a decode replica
is short when time per output token grows, its KV cache fills or it runs too many requests.
Each engine replica records those signals (`EngineServer.record_autoscaling_stats`, pulled by
Serve), and `PDAutoscalingPolicy` (a deployment's `autoscaling_config.policy`, one instance
per role) turns them into a replica count. Serve's wrapper around a custom policy applies
`min_replicas` / `max_replicas`, `upscale_delay_s` / `downscale_delay_s` (the cool-downs) and
the scaling factors; the decision itself is the pure `desired_replicas`, tested with
synthetic metrics.

The rule: pressure = the largest ratio of a signal to its target. Above 1 the role grows in
proportion (2x over target: twice the replicas); below `headroom` (every signal well under
target) it shrinks in proportion, never below one; in between it holds. No signal yet (no
replica has reported): hold.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from engine.core.kv_events import EngineLoad

ROLES = ("prefill", "decode")
DEFAULT_LOOK_BACK_S = 30.0  # Serve's default look_back_period_s


@dataclass(frozen=True)
class SLOTargets:
    ttft_s: float = 2.0  # prefill: mean time to first token over the recent window
    queued_prompt_tokens: float = 8192.0  # prefill: per replica, prompts not yet answered
    tpot_s: float = 0.2  # decode: mean time per output token after the first
    kv_cache_usage: float = 0.85  # decode: mean fraction of KV blocks in use
    running_requests: float = 64.0  # decode: per replica
    headroom: float = 0.5  # shrink when every signal is under this fraction of its target

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SLO target {name} must be a number > 0, got {value!r}")
        if self.headroom >= 1:
            raise ValueError(f"headroom must be < 1, got {self.headroom}")


@dataclass(frozen=True)
class RoleLoad:
    """What each replica of a role reported (one value per replica per signal)."""

    ttft_s: list[float] = field(default_factory=list)
    queued_prompt_tokens: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    kv_cache_usage: list[float] = field(default_factory=list)
    running_requests: list[float] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Mapping[Any, float]]) -> RoleLoad:
        """From Serve's aggregated custom metrics: {name: {replica: value}}."""
        names = [f.name for f in fields(cls)]
        return cls(
            **{name: [float(v) for v in (metrics.get(name) or {}).values()] for name in names}
        )


def pressure(role: str, load: RoleLoad, slo: SLOTargets, replicas: int) -> float | None:
    """The largest signal-to-target ratio of the role; None without any signal."""
    replicas = max(1, replicas)
    if role == "prefill":
        ratios = [
            _mean(load.ttft_s, slo.ttft_s),
            _total(load.queued_prompt_tokens, slo.queued_prompt_tokens * replicas),
        ]
    elif role == "decode":
        ratios = [
            _mean(load.tpot_s, slo.tpot_s),
            _mean(load.kv_cache_usage, slo.kv_cache_usage),
            _total(load.running_requests, slo.running_requests * replicas),
        ]
    else:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    known = [r for r in ratios if r is not None]
    return max(known) if known else None


def desired_replicas(role: str, load: RoleLoad, slo: SLOTargets, current: int) -> int:
    current = max(1, current)
    p = pressure(role, load, slo, current)
    if p is None:
        return current
    if p > 1:
        return math.ceil(current * p)
    if p < slo.headroom:
        return max(1, math.ceil(current * p / slo.headroom))
    return current


def _mean(values: list[float], target: float) -> float | None:
    return sum(values) / len(values) / target if values else None


def _total(values: list[float], target: float) -> float | None:
    return sum(values) / target if values else None


class PDAutoscalingPolicy:
    """A deployment's `autoscaling_config.policy`: {"policy_function":
    "deployments.cluster.sla_autoscaling:PDAutoscalingPolicy", "policy_kwargs": {"role": "decode",
    ...SLOTargets fields}}. Serve builds one per deployment and calls it with an
    AutoscalingContext each tick."""

    def __init__(self, role: str, **targets: float) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.slo = SLOTargets(**targets)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        load = RoleLoad.from_metrics(ctx.aggregated_metrics or {})
        return desired_replicas(self.role, load, self.slo, ctx.current_num_replicas), {}


class RecentLatencies:
    """An engine replica's TTFT and TPOT over the last `window_s` seconds (old requests say
    nothing of the load now: an idle replica reports none, and its role may shrink)."""

    def __init__(
        self, window_s: float = DEFAULT_LOOK_BACK_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.clock = clock  # a simulator's own (pdserve bench router-sim)
        # The event loop observes, the KV publisher's thread reads means.
        self._lock = threading.Lock()
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()

    def observe(self, ttft_s: float | None, tpot_s: float | None) -> None:
        now = self.clock()
        with self._lock:
            if ttft_s is not None:
                self._ttft.append((now, ttft_s))
            if tpot_s is not None:
                self._tpot.append((now, tpot_s))
            self._forget_before(now - self.window_s)  # bounded even if nobody asks

    def _forget_before(self, horizon: float) -> None:
        for samples in (self._ttft, self._tpot):
            while samples and samples[0][0] < horizon:
                samples.popleft()

    def with_means(self, load: EngineLoad) -> EngineLoad:
        """`load` with these means (the KV index's role balancer weighs them)."""
        means = self.means()
        return load._replace(ttft_s=means.get("ttft_s"), tpot_s=means.get("tpot_s"))

    def means(self) -> dict[str, float]:
        """{"ttft_s": ..., "tpot_s": ...}, each only where the window holds a request."""
        with self._lock:
            self._forget_before(self.clock() - self.window_s)
            means = {}
            for name, samples in (("ttft_s", self._ttft), ("tpot_s", self._tpot)):
                if samples:
                    means[name] = sum(v for _, v in samples) / len(samples)
        return means


# Serve's autoscaling_config fields an `sla_autoscaling` spec may set (the rest are targets).
_SERVE_FIELDS = {
    "min_replicas": 1,
    "max_replicas": 4,
    "upscale_delay_s": 10.0,
    "downscale_delay_s": 60.0,
    "look_back_period_s": DEFAULT_LOOK_BACK_S,  # must exceed metrics_interval_s
    # How often each replica reports its signals to Serve's controller. Serve 2.60 marks the
    # field deprecated in favour of environment variables it does not read yet: the field is
    # still the only setting that moves the interval.
    "metrics_interval_s": 10.0,
}
POLICY_PATH = f"{__name__}:PDAutoscalingPolicy"


def latency_window_s(spec: Mapping[str, Any] | None) -> float:
    """How far back an engine replica's TTFT and TPOT means look: as far as Serve averages
    them (`look_back_period_s` of the app's `sla_autoscaling`), so a role whose load is gone
    shrinks within about two look-back periods (the replica's window, then Serve's), not
    after a fixed 30 s whatever the period."""
    return float((spec or {}).get("look_back_period_s", _SERVE_FIELDS["look_back_period_s"]))


def autoscaling_config(role: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Serve's autoscaling_config for one role from the app's `sla_autoscaling` spec (SLO
    targets and Serve's bounds and cool-downs in one dict); ValueError for an unknown key or
    a bad target."""
    targets_fields = {f.name for f in fields(SLOTargets)}
    unknown = sorted(set(spec) - targets_fields - set(_SERVE_FIELDS))
    if unknown:
        known = ", ".join(sorted(targets_fields | set(_SERVE_FIELDS)))
        raise ValueError(f"sla_autoscaling: unknown key(s) {unknown}; known: {known}")
    targets = {k: v for k, v in spec.items() if k in targets_fields}
    PDAutoscalingPolicy(role, **targets)  # checks the targets now, not in Serve's controller
    serve_fields = {k: spec.get(k, default) for k, default in _SERVE_FIELDS.items()}
    # Serve only warns; a window holding at most one report averages nothing.
    if float(serve_fields["look_back_period_s"]) <= float(serve_fields["metrics_interval_s"]):
        raise ValueError(
            f"sla_autoscaling: look_back_period_s ({serve_fields['look_back_period_s']}) must "
            f"be greater than metrics_interval_s ({serve_fields['metrics_interval_s']})"
        )
    return {
        **serve_fields,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {"role": role, **targets}},
    }
