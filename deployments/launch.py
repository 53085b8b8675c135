"""`pdserve serve`: local Ray, Serve's HTTP and gRPC proxies, the pdserve app; blocks until
interrupted (SIGINT or SIGTERM), then shuts Serve and Ray down."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from deployments.app import AppConfig, build_app

logger = logging.getLogger(__name__)

GRPC_SERVICER = "protos.pdserve.v1.generate_pb2_grpc.add_GenerationServicer_to_server"
APP_NAME = "pdserve"
COLOCATED_APP_NAME = "colocated"


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000
    num_cpus: int | None = None  # Ray's logical CPUs; default: enough for every replica
    # More apps beside the main one, for side-by-side benches: name -> AppConfig overrides
    # (e.g. {"colocated": {"colocated": True}}); each is served at route /<name> and by its
    # name in gRPC metadata.
    extra_apps: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def num_apps(self) -> int:
        return 1 + len(self.extra_apps)


def start(config: AppConfig, options: ServeOptions) -> dict[str, str]:
    """Start Ray and Serve and deploy; returns where the app listens."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    _init_local_ray(options.num_cpus or _logical_cpus(config, options))
    serve.start(
        http_options=HTTPOptions(host=options.host, port=options.http_port),
        grpc_options=gRPCOptions(port=options.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]),
    )
    args = asdict(config)
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    where = {
        "grpc": f"{options.host}:{options.grpc_port}",
        "http": f"http://{options.host}:{options.http_port}",
    }
    for name, overrides in options.extra_apps.items():
        extra = AppConfig.from_args({**args, **overrides})
        serve.run(build_app(asdict(extra)), name=name, route_prefix=f"/{name}")
        where[f"{name}_http"] = f"{where['http']}/{name}"
    return where


# Ray waits a fixed 30 s for its raylet to register with the GCS; on a loaded 2-core machine
# that start-up has been seen to miss it once in many runs. A second try then succeeds.
_RAY_START_ATTEMPTS = 2


def _init_local_ray(num_cpus: int) -> None:
    import ray

    for attempt in range(1, _RAY_START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",  # always a fresh local cluster, never one found on the machine
                num_cpus=num_cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(exc) or attempt == _RAY_START_ATTEMPTS:
                raise
            logger.warning("Ray's node did not start in time; starting it again")
            ray.shutdown()


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
            + "".join(f", app {n!r} at {where[f'{n}_http']}" for n in options.extra_apps),
            flush=True,
        )
        print("pdserve: press Ctrl-C to stop", flush=True)
        stopping.wait()
    finally:
        print("pdserve: shutting down", flush=True)
        stop()


def _logical_cpus(config: AppConfig, options: ServeOptions) -> int:
    """Enough logical CPUs for every replica (Ray schedules on them; cores are shared)."""
    engines = options.num_apps * (config.decode_replicas + config.prefill_replicas)
    needed = engines * config.num_cpus_per_engine + 2 * config.num_cpus_router + 1
    return max(os.cpu_count() or 1, int(needed + 0.999))
