"""`pdserve serve`: local Ray, Serve's HTTP and gRPC proxies, the pdserve app; blocks until
interrupted (SIGINT or SIGTERM), then shuts Serve and Ray down."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from deployments.app import AppConfig, build_app

GRPC_SERVICER = "protos.pdserve.v1.generate_pb2_grpc.add_GenerationServicer_to_server"
APP_NAME = "pdserve"
COLOCATED_APP_NAME = "colocated"


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000
    num_cpus: int | None = None  # Ray's logical CPUs; default: enough for every replica
    with_colocated: bool = False  # also deploy the colocated app (for side-by-side benches)


def start(config: AppConfig, options: ServeOptions) -> dict[str, str]:
    """Start Ray and Serve and deploy; returns where the app listens."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    ray.init(
        num_cpus=options.num_cpus or _logical_cpus(config, options),
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    serve.start(
        http_options=HTTPOptions(host=options.host, port=options.http_port),
        grpc_options=gRPCOptions(port=options.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]),
    )
    args = _as_args(config)
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    where = {
        "grpc": f"{options.host}:{options.grpc_port}",
        "http": f"http://{options.host}:{options.http_port}",
    }
    if options.with_colocated:
        colocated = {**args, "colocated": True}
        serve.run(build_app(colocated), name=COLOCATED_APP_NAME, route_prefix="/colocated")
        where["colocated_http"] = f"{where['http']}/colocated"
    return where


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run_until_interrupted(config: AppConfig, options: ServeOptions) -> None:
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        where = start(config, options)
        mode = "colocated" if config.colocated else f"disaggregated over {config.transport}"
        print(
            f"pdserve: serving model {config.model!r} ({mode}); "
            f"gRPC on {where['grpc']}, HTTP on {where['http']}"
            + (f", colocated app at {where['colocated_http']}" if options.with_colocated else ""),
            flush=True,
        )
        print("pdserve: press Ctrl-C to stop", flush=True)
        stopping.wait()
    finally:
        print("pdserve: shutting down", flush=True)
        stop()


def _logical_cpus(config: AppConfig, options: ServeOptions) -> int:
    """Enough logical CPUs for every replica (Ray schedules on them; cores are shared)."""
    engines = config.decode_replicas + (0 if config.colocated else config.prefill_replicas)
    if options.with_colocated:
        engines += config.decode_replicas
    needed = engines * config.num_cpus_per_engine + 2 * config.num_cpus_router + 1
    return max(os.cpu_count() or 1, int(needed + 0.999))


def _as_args(config: AppConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)
