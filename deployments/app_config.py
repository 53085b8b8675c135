"""AppConfig: the pdserve app's settings, as `serve run` key=value arguments, a serve config's
typed `args` or `pdserve serve`'s flags give them, checked before anything is deployed
(deployments/app.py builds the app from them)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from deployments.cluster.role_balance import RoleSwitching
from deployments.cluster.sla_autoscaling import autoscaling_config
from deployments.credentials import (
    configured_keys,
    side_channel_tls_from_env,
)
from deployments.protocol import RequestLimits
from deployments.router.migration import MigrationPolicy
from deployments.router.orchestrator import FlowConfig
from engine.config import (
    KVFaultInjection,
    SideChannelTLS,
    check_known_keys,
    check_load_failure_policy,
    check_transport,
    config_from_dict,
)
from engine.models.catalog import SMOLLM2_MODEL

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class AppConfig:
    """The app's settings: `serve run` arguments, a serve config's `args`, `pdserve serve`'s
    flags (pdserve/serve_command.py makes one from each field, with the docstring as help)."""

    model: str = SMOLLM2_MODEL
    """a named model (smollm2, tiny), a model directory or a .gguf file"""
    served_model_name: str = ""
    """the model name clients use (empty: the model's short name or file stem)"""
    colocated: bool = False
    """one engine deployment does prefill and decode (for comparison)"""
    transport: str = "nixl"
    """how KV moves from prefill to decode engines: nixl or grpc"""
    prefill_replicas: int = 1
    """prefill engine replicas (a fixed count; autoscaling replaces it)"""
    decode_replicas: int = 1
    """decode engine replicas (a fixed count; autoscaling replaces it)"""
    prefill_tensor_parallel_size: int = 0
    """ranks (processes, each with its cores or GPU) per prefill engine replica; 0: engine_args'
    tensor_parallel_size, else 1"""
    decode_tensor_parallel_size: int = 0
    """ranks per decode (or colocated) engine replica; 0: engine_args' tensor_parallel_size,
    else 1"""
    prefill_autoscaling: dict[str, Any] | None = None
    """Serve's autoscaling_config for the prefill replicas (JSON), instead of a fixed count"""
    decode_autoscaling: dict[str, Any] | None = None
    """Serve's autoscaling_config for the decode replicas (JSON), instead of a fixed count"""
    sla_autoscaling: dict[str, Any] | None = None
    """P/D-aware autoscaling of both roles against SLO targets (deployments/cluster/
    sla_autoscaling.py), JSON: {"ttft_s": 2, "tpot_s": 0.2, "kv_cache_usage": 0.85, ...,
    "min_replicas": 1, "max_replicas": 4}; replaces the two above"""
    role_switching: dict[str, Any] | None = None
    """engine replicas switch between prefill and decode at runtime so that the P:D ratio
    follows the load (deployments/cluster/role_balance.py; needs kv_aware_routing), JSON:
    {"ttft_s": 2, "tpot_s": 0.2, ..., "interval_s": 10, "max_step": 0.25, "min_replicas": 1,
    "drain_timeout_s": 30}; none: each replica keeps its deployment's role"""
    router_replicas: int = 1
    """router (ingress) replicas"""
    num_cpus_per_engine: float = 1.0
    """Ray CPUs per engine replica, per rank under tensor parallelism (on CPU nodes, the
    threads each rank computes with)"""
    pin_engine_cores: bool = True
    """on CPU nodes, pin each engine replica's threads to cores no other engine replica holds
    (deployments/replica/core_pinning.py)"""
    num_gpus_per_engine: float = 0.0
    """GPUs per engine replica, per rank under tensor parallelism (one each on a GPU
    cluster)"""
    num_cpus_router: float = 0.5
    """Ray CPUs per router replica"""
    max_ongoing_requests: int = 256
    """requests an engine replica takes at once (the engine queues behind it)"""
    max_queued_requests: int = 1024
    """requests waiting at each router replica for each engine deployment, beyond which they
    are refused at once (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After); -1: no bound"""
    router_max_queued_requests: int = 4096
    """requests waiting at each proxy for a router replica, beyond which Serve refuses them
    (429); -1: no bound"""
    max_queued_prompt_tokens: int = 262144
    """prompt tokens an engine holds still to compute, beyond which it refuses new requests
    (engine/core/admission.py); 0: no bound; engine_args may set its own"""
    retry_after_s: float = 1.0
    """what a refused client is told to wait before retrying"""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """engine arguments (vLLM's names) for every engine replica, JSON, e.g.
    {"max_model_len": 512}"""
    kv_secret: str = ""
    """shared by the engines' side channels; empty: $PDSERVE_KV_SECRET (a Kubernetes Secret),
    else drawn once per build (then engines of two builds refuse each other's KV)"""
    api_key: str | list[str] = field(default_factory=list)
    """clients must send 'Authorization: Bearer KEY' (HTTP) or metadata 'authorization: Bearer
    KEY' (gRPC); one or a list, plus $PDSERVE_API_KEY (comma-separated); none: open APIs"""
    lease_seconds: float = 30.0
    """how long a prefill engine holds a finished prompt's KV for its decode engine to read"""
    kv_load_failure_policy: str = "recompute"
    """a KV read that fails: recompute the prompt locally, or fail the request"""
    side_channel_tls: dict[str, str] | None = None
    """mutual TLS on the engines' side channel, JSON: {certfile, keyfile, ca_certs,
    server_name} (PEM paths on every node, e.g. a mounted Secret); none: from
    $PDSERVE_SIDE_CHANNEL_TLS_DIR (a cert-manager Secret's tls.crt, tls.key, ca.crt) and
    $PDSERVE_SIDE_CHANNEL_TLS_NAME, where set"""
    kv_fault_injection: dict[str, Any] | None = None
    """faults injected into the engines' KV reads, to prove the checksums catch them (bench
    chaos), JSON: {rate, faults, seed}; none by default"""
    min_remote_prefill_tokens: int = FlowConfig.min_remote_prefill_tokens
    """shorter prompts skip the prefill replica"""
    max_local_prefill_tokens: int = FlowConfig.max_local_prefill_tokens
    """a prompt of which a decode replica holds all but at most this many tokens skips the
    prefill replica (cache-aware disaggregation; needs kv_aware_routing; 0: off)"""
    min_prefix_loan_tokens: int = FlowConfig.min_prefix_loan_tokens
    """the prefill replica borrows a prompt's cached blocks from the engine holding the most
    of them when that spares at least this many tokens (needs kv_aware_routing; 0: off)"""
    kv_aware_routing: bool = True
    """route both legs by the engines' prefix caches (deployments/cluster/kv_index.py); off:
    Serve's default (power of two choices)"""
    request_timeout_s: float = FlowConfig.request_timeout_s
    """a request's deadline (a request may ask for less)"""
    prefill_timeout_s: float = FlowConfig.prefill_timeout_s
    """a prefill leg that gives no answer in this time falls back to decode-only"""
    max_migrations: int = MigrationPolicy.max_migrations
    """a request whose decode (or colocated) engine fails mid-stream moves to another engine
    at most this many times (deployments/router/migration.py); 0: it fails with the engine"""
    otlp_endpoint: str = ""
    """OTLP/gRPC collector for traces (empty: $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing)"""
    max_body_bytes: int = RequestLimits.max_body_bytes
    """HTTP request bodies larger than this are refused (413)"""
    max_prompt_chars: int = RequestLimits.max_prompt_chars
    """characters of a text prompt, or of a conversation's contents together"""
    max_stop_strings: int = RequestLimits.max_stop_strings
    """stop strings in one request"""
    max_stop_chars: int = RequestLimits.max_stop_chars
    """characters of each stop string"""
    max_request_id_chars: int = RequestLimits.max_request_id_chars
    """characters of a client-chosen request id"""

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """From `serve run` key=value strings or a serve config's typed `args` (ValueError)."""
        args = dict(args or {})
        check_known_keys("app argument(s)", args, cls)
        defaults = cls()
        values = {
            name: _coerce(name, value, getattr(defaults, name)) for name, value in args.items()
        }
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        check_transport(self.transport)
        check_load_failure_policy(self.kv_load_failure_policy, "kv_load_failure_policy")
        for name in ("prefill_replicas", "decode_replicas", "router_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_local_prefill_tokens", "min_prefix_loan_tokens", "max_migrations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        for name in ("max_queued_requests", "router_max_queued_requests"):
            if getattr(self, name) < 1 and getattr(self, name) != -1:
                raise ValueError(f"{name} must be >= 1, or -1 for no bound")
        if self.max_queued_prompt_tokens < 0 or self.retry_after_s < 0:
            raise ValueError("max_queued_prompt_tokens and retry_after_s must be >= 0")
        if self.request_timeout_s <= 0 or self.prefill_timeout_s <= 0:
            raise ValueError("request_timeout_s and prefill_timeout_s must be > 0")
        configured_keys(self.api_key, {})
        self.tls()
        if self.kv_fault_injection is not None:
            config_from_dict("kv_fault_injection", self.kv_fault_injection, KVFaultInjection)
        if "kv_transfer_config" in self.engine_args:
            raise ValueError("engine_args may not set kv_transfer_config: the app builds it")
        for role in ("prefill", "decode"):
            self.tensor_parallel_size(role)
        if self.sla_autoscaling is not None:
            if self.prefill_autoscaling or self.decode_autoscaling:
                raise ValueError(
                    "sla_autoscaling replaces prefill_autoscaling and decode_autoscaling: "
                    "set one or the other"
                )
            if self.colocated:
                raise ValueError(
                    "sla_autoscaling scales prefill and decode replicas: not colocated"
                )
            if self.autoscaling("prefill")["min_replicas"] < 1:  # type: ignore[index]
                raise ValueError("sla_autoscaling.min_replicas must be >= 1")
        if self.role_switching is not None:
            if self.colocated or not self.kv_aware_routing:
                raise ValueError(
                    "role_switching needs prefill and decode replicas and kv_aware_routing"
                )
            if self.sla_autoscaling is not None:
                # A switched replica's signals would count for its deployment's old role.
                raise ValueError("role_switching and sla_autoscaling: set one or the other")
            if self.max_migrations < 1:
                # A request outstaying a switch's drain moves: with migration off it would fail.
                raise ValueError("role_switching needs max_migrations >= 1")
            RoleSwitching.from_spec(self.role_switching)
        prefill_min = (self.prefill_autoscaling or {}).get("min_replicas", 1)
        if not self.colocated and prefill_min < 1:
            # With no prefill replica the router goes decode-only and sends the prefill
            # deployment no request: Serve would see no demand to scale it up from zero.
            raise ValueError("prefill_autoscaling.min_replicas must be >= 1")
        self.limits()

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks per engine replica of `role` ("prefill"; "decode" and "colocated" share one):
        the role's own field, else engine_args' tensor_parallel_size, else 1."""
        own = self.prefill_tensor_parallel_size
        if role != "prefill":
            own = self.decode_tensor_parallel_size
        size = own or self.engine_args.get("tensor_parallel_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or own < 0:
            raise ValueError(f"{role} tensor_parallel_size must be an integer >= 1, got {size!r}")
        return size

    def sized_engine_args(self, engine_args: dict[str, Any], role: str) -> dict[str, Any]:
        """`engine_args` with the role's tensor_parallel_size."""
        return {**engine_args, "tensor_parallel_size": self.tensor_parallel_size(role)}

    def autoscaling(self, role: str) -> dict[str, Any] | None:
        """Serve's autoscaling_config for an engine role ("prefill", "decode", "colocated");
        None: a fixed replica count."""
        if self.sla_autoscaling is not None and role != "colocated":
            return autoscaling_config(role, self.sla_autoscaling)
        return self.prefill_autoscaling if role == "prefill" else self.decode_autoscaling

    def kv_transfer_config(self) -> dict[str, Any]:
        tls = self.tls()
        return {
            "connector": self.transport,
            "secret": self.kv_secret,
            "lease_seconds": self.lease_seconds,
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "tls": dataclasses.asdict(tls) if tls is not None else None,
            "fault_injection": self.kv_fault_injection,
        }

    def tls(self) -> SideChannelTLS | None:
        if self.side_channel_tls is not None:
            return config_from_dict("side_channel_tls", self.side_channel_tls, SideChannelTLS)
        return side_channel_tls_from_env(os.environ)

    def limits(self) -> RequestLimits:
        names = RequestLimits.__dataclass_fields__
        return RequestLimits(**{name: getattr(self, name) for name in names})

    def flow(self) -> FlowConfig:
        return FlowConfig(
            min_remote_prefill_tokens=self.min_remote_prefill_tokens,
            max_local_prefill_tokens=self.max_local_prefill_tokens,
            min_prefix_loan_tokens=self.min_prefix_loan_tokens,
            request_timeout_s=self.request_timeout_s,
            prefill_timeout_s=self.prefill_timeout_s,
            migration=MigrationPolicy(max_migrations=self.max_migrations),
            limits=self.limits(),
            retry_while_starting_s=None if self._may_scale_to_zero() else self.retry_after_s,
        )

    def _may_scale_to_zero(self) -> bool:
        """Whether no engine replica at all may be what the app asks for (colocated replicas
        autoscaled from 0; a P/D app keeps a prefill replica)."""
        autoscaling = self.autoscaling("colocated") if self.colocated else None
        return autoscaling is not None and autoscaling.get("min_replicas", 1) == 0


def _coerce(name: str, value: Any, default: Any) -> Any:
    """`serve run` passes strings: turn them into the field's type."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    if isinstance(default, bool):
        lowered = value.lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if isinstance(default, (int, float)):
        try:
            return type(default)(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if isinstance(default, dict) or default is None:
        import json

        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be JSON, got {value!r}: {exc}") from None
    return value
