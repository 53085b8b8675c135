"""build_app(args): the pdserve Serve application (`serve run`, `serve deploy`, `pdserve serve`).

    serve run deployments.app:build_app model=smollm2 prefill_replicas=1 decode_replicas=2
    serve deploy deployments/serve_config.yaml

Disaggregated (default): Router -> PrefillServer + DecodeServer, KV moved between them over
NIXL or gRPC. `colocated=true`: Router -> one EngineServer deployment doing both, for comparison.
"""

from __future__ import annotations

import os
from typing import Any

from deployments.app_config import AppConfig
from deployments.cluster.sla_autoscaling import latency_window_s
from deployments.credentials import ApiKeys, kv_secret_to_bind


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The Serve Application (Router ingress bound to its engine deployments)."""
    config = AppConfig.from_args(args)
    # Resolved once here and bound into every replica's arguments (or, from the environment,
    # a reference each replica resolves on its node): all engines share it.
    config.kv_secret = kv_secret_to_bind(config.kv_secret, os.environ)
    engine_args: dict[str, Any] = {"max_queued_prompt_tokens": config.max_queued_prompt_tokens}
    engine_args.update(config.engine_args)
    settings = _router_settings(config, engine_args)
    if config.kv_aware_routing:
        # The engines publish their prefix caches' events; the legs' routers read them.
        engine_args = {"kv_events_config": {"enable_kv_cache_events": True}, **engine_args}
    return _router(config).bind(settings, *_engines(config, engine_args))


def _router_settings(config: AppConfig, engine_args: dict[str, Any]) -> Any:
    from deployments.router.router import RouterSettings

    return RouterSettings(
        model=config.model,
        engine_args=engine_args,
        flow=config.flow(),
        kv_secret=config.kv_secret,
        transport="" if config.colocated else config.transport,
        served_model_name=config.served_model_name,
        otlp_endpoint=config.otlp_endpoint,
        kv_aware_routing=config.kv_aware_routing,
        retry_after_s=config.retry_after_s,
        api_keys=ApiKeys.resolve(config.api_key),
        side_channel_tls=config.tls(),
        role_switching=config.role_switching is not None,
    )


# How often a replica told to stop (app deleted or redeployed, scale-down, shutdown) looks
# for requests still running. Serve's default, 2 s, is also the least an idle replica waits:
# each tier (routers, then engines) of every delete and shutdown paid it.
DRAIN_POLL_S = 0.25


def _router(config: AppConfig) -> Any:
    """The Router deployment: the app's ingress."""
    from deployments.router.router import RouterDeployment

    return RouterDeployment.options(
        num_replicas=config.router_replicas,
        max_ongoing_requests=config.max_ongoing_requests * 4,
        max_queued_requests=config.router_max_queued_requests,
        # The proxy's own answer over the bound: 429 with Retry-After (gRPC:
        # RESOURCE_EXHAUSTED), as the engines' bounds answer through the Router.
        backpressure_config={"status_code": 429, "retry_after_s": config.retry_after_s},
        ray_actor_options={"num_cpus": config.num_cpus_router},
        # A router replica told to stop lets its streams end, as an engine does (Serve's
        # default, 20 s, cut longer ones on every scale-down and drain).
        graceful_shutdown_timeout_s=config.request_timeout_s,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        # Its replicas find each other through it (Abort of a request another one holds).
        request_router_config=_request_router(config, "router", kv_aware=False),
    )


def _engines(config: AppConfig, engine_args: dict[str, Any]) -> list[Any]:
    """The engine deployments the Router is bound to: decode then prefill, or the colocated
    one."""
    from deployments.replica.engine_server import (
        ColocatedDeployment,
        DecodeDeployment,
        PrefillDeployment,
    )

    extras = {
        "otlp_endpoint": config.otlp_endpoint,
        "pin_cores": config.pin_engine_cores,
        "latency_window_s": latency_window_s(config.sla_autoscaling),
    }
    if config.colocated:
        engine = ColocatedDeployment.options(
            **_engine_options(
                config, config.autoscaling("colocated"), config.decode_replicas, "colocated"
            ),
            **_decode_router(config, "colocated"),
        )
        colocated_args = config.sized_engine_args(engine_args, "colocated")
        return [engine.bind(config.model, colocated_args, None, **extras)]
    kv = config.kv_transfer_config()
    extras["role_switching"] = config.role_switching
    prefill = PrefillDeployment.options(
        **_engine_options(
            config, config.autoscaling("prefill"), config.prefill_replicas, "prefill"
        ),
        # The prefill leg's router also tells the Router when no prefill replica runs (it
        # then goes decode-only at once).
        request_router_config=_request_router(config, "prefill"),
    )
    decode = DecodeDeployment.options(
        **_engine_options(config, config.autoscaling("decode"), config.decode_replicas, "decode"),
        **_decode_router(config, "decode"),
    )
    return [
        decode.bind(config.model, config.sized_engine_args(engine_args, "decode"), kv, **extras),
        prefill.bind(config.model, config.sized_engine_args(engine_args, "prefill"), kv, **extras),
    ]


def _decode_router(config: AppConfig, role: str) -> dict[str, Any]:
    """Decode (and colocated) replicas: Serve's default choice unless routed by cache; either
    way the router publishes the replica set (a request whose decode replica died moves to a
    prefill replica when none is left)."""
    return {"request_router_config": _request_router(config, role)}


def _request_router(config: AppConfig, role: str, kv_aware: bool = True) -> dict[str, Any]:
    """Serve's `request_router_config` for one role's deployment."""
    if not (kv_aware and config.kv_aware_routing):
        return {
            "request_router_class": "deployments.cluster.request_routers.ReplicaSetRouter",
            "request_router_kwargs": {"role": role},
        }
    from engine.arg_utils import EngineArgs

    block_size = int(config.engine_args.get("block_size", EngineArgs.block_size))
    return {
        "request_router_class": "deployments.cluster.request_routers.KVAwareRouter",
        "request_router_kwargs": {"role": role, "block_size": block_size},
    }


def _engine_options(
    config: AppConfig, autoscaling: dict[str, Any] | None, replicas: int, role: str
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_queued_requests,
        "ray_actor_options": {
            "num_cpus": config.num_cpus_per_engine,
            # Every rank's GPU (the ranks are the replica's processes: _rank_bundles).
            "num_gpus": config.num_gpus_per_engine * config.tensor_parallel_size(role),
        },
        # Engine start-up loads weights and allocates the KV cache: give it time.
        "health_check_timeout_s": 60,
        # Scaling down waits for the replica's requests to end (up to their deadline).
        "graceful_shutdown_timeout_s": config.request_timeout_s,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }
    if autoscaling:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    options.update(_rank_bundles(config, role))
    return options


def _rank_bundles(config: AppConfig, role: str) -> dict[str, Any]:
    """A replica of several tensor-parallel ranks reserves a bundle per rank, all on one node
    (its ranks are processes it starts there); the replica actor takes the first. GPUs go in
    the first bundle, all of them: Ray makes the replica's devices visible to it alone, and
    its ranks (its child processes) compute on them, rank r on the r-th."""
    size = config.tensor_parallel_size(role)
    if size == 1:
        return {}
    cpus, gpus = config.num_cpus_per_engine, config.num_gpus_per_engine
    first = {"CPU": cpus, **({"GPU": gpus * size} if gpus else {})}
    return {
        "placement_group_bundles": [first] + [{"CPU": cpus}] * (size - 1),
        "placement_group_strategy": "STRICT_PACK",
    }
