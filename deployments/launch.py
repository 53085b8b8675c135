"""`pdserve serve`: local Ray, Serve's HTTP and gRPC proxies, the pdserve app; blocks until
interrupted (SIGINT or SIGTERM), then shuts Serve and Ray down."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from deployments.app import build_app
from deployments.app_config import AppConfig
from deployments.router.grpc_ingress import SERVICER_FUNCTION

logger = logging.getLogger(__name__)

# Serve's gRPC proxy reads its message bound from the environment (Ray 2.60). 4 MiB, gRPC's
# own default, holds a prompt of 100k+ tokens as text or ids; the HTTP side has max_body_bytes.
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
GRPC_MAX_MESSAGE_BYTES = 4 << 20

APP_NAME = "pdserve"
COLOCATED_APP_NAME = "colocated"


@dataclass
class ServeOptions:
    """Where and how `pdserve serve` runs the app on local Ray (its flags come from here)."""

    host: str = "127.0.0.1"
    """the address Serve's HTTP and gRPC proxies listen on"""
    http_port: int = 8000
    """the OpenAI-compatible HTTP API (HTTPS with --ssl-certfile)"""
    grpc_port: int = 9000
    """the gRPC API (pdserve.v1.Generation), plain"""
    num_cpus: int | None = None
    """Ray's logical CPUs (none: enough for every replica)"""
    extra_apps: dict[str, dict[str, Any]] = field(default_factory=dict)
    """more apps beside the main one, for side-by-side benches: name -> AppConfig overrides
    (e.g. {"colocated": {"colocated": True}}), each at route /<name> and by its name in gRPC
    metadata"""
    dashboard_port: int | None = None
    """Ray's dashboard, which Serve's CLI (serve status) talks to (none: no dashboard)"""
    metrics_export_port: int | None = None
    """Prometheus metrics of every process, at /metrics (none: Ray picks the port)"""
    ssl_keyfile: str | None = None
    """TLS key (PEM): HTTPS on the HTTP port, gRPC over TLS on the gRPC TLS port"""
    ssl_certfile: str | None = None
    """TLS certificate chain (PEM)"""
    grpc_tls_port: int = 9443
    """gRPC over TLS, beside the plain port (with --ssl-certfile;
    deployments/router/grpc_ingress.py)"""
    grpc_max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES
    """the largest gRPC message the proxies take (Serve's default, 2 GiB, would be read and
    decoded before the API key is checked)"""

    def __post_init__(self) -> None:
        if not 1024 <= self.grpc_max_message_bytes < 2**31:
            raise ValueError(
                "grpc_max_message_bytes must be between 1024 and 2**31 - 1, "
                f"got {self.grpc_max_message_bytes}"
            )

    @property
    def tls(self) -> bool:
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("give both --ssl-keyfile and --ssl-certfile, or neither")
        return bool(self.ssl_certfile)

    @property
    def num_apps(self) -> int:
        return 1 + len(self.extra_apps)


# Below the kernel's ephemeral range and above Ray's worker ports (10002-19999 by default).
_FREE_PORTS_FROM = 20000


def free_port() -> int:
    """A TCP port nothing on 127.0.0.1 listens on right now (for apps started side by side),
    below the kernel's ephemeral range: a port from that range (what binding port 0 gives)
    can become the source port of any connection made before its server binds it, and Ray
    makes many while it starts."""
    ephemeral_low = _ephemeral_low()
    for _ in range(100 if ephemeral_low > _FREE_PORTS_FROM else 0):
        port = random.randrange(_FREE_PORTS_FROM, ephemeral_low)
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    with socket.socket() as sock:  # no room below the range: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's range for source ports (Linux); IANA's where it cannot
    be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def deploy(
    config: AppConfig, extra_apps: Mapping[str, Mapping[str, Any]], wait: bool = True
) -> None:
    """The main app at route / and each extra app (its overrides of the main app's settings)
    at /<name>, deployed together: their replicas start side by side, not one app's after
    the other's. Returns once every app is running (`wait`), else once Serve has them."""
    from ray import serve

    args = asdict(config)
    targets = [serve.RunTarget(build_app(args), name=APP_NAME, route_prefix="/")]
    for name, overrides in extra_apps.items():
        extra = asdict(AppConfig.from_args({**args, **overrides}))
        targets.append(serve.RunTarget(build_app(extra), name=name, route_prefix=f"/{name}"))
    serve.run_many(targets, wait_for_applications_running=wait)


def start(
    config: AppConfig, options: ServeOptions, after_ray_init: Callable[[], None] | None = None
) -> dict[str, str]:
    """Start Ray and Serve and deploy; returns where the app listens. `after_ray_init` runs
    as soon as Ray is up (before the engines load, which takes minutes)."""

    with proxy_environment(options):
        _init_local_ray(options.num_cpus or _logical_cpus(config, options), options)
    if after_ray_init is not None:
        after_ray_init()
    start_serve(options)
    deploy(config, options.extra_apps)
    where = {
        "grpc": f"{options.host}:{options.grpc_port}",
        "http": f"{'https' if options.tls else 'http'}://{options.host}:{options.http_port}",
    }
    if options.tls:
        where["grpc_tls"] = f"{options.host}:{options.grpc_tls_port}"
    for name in options.extra_apps:
        where[f"{name}_http"] = f"{where['http']}/{name}"
    if options.dashboard_port is not None:
        where["dashboard"] = f"http://{options.host}:{options.dashboard_port}"
    if options.metrics_export_port is not None:
        where["metrics"] = f"http://{options.host}:{options.metrics_export_port}/metrics"
    return where


def start_serve(options: ServeOptions) -> None:
    """Serve on the Ray this process is connected to, its proxies where `options` say."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    serve.start(
        http_options=HTTPOptions(
            host=options.host,
            port=options.http_port,
            ssl_keyfile=options.ssl_keyfile,
            ssl_certfile=options.ssl_certfile,
        ),
        grpc_options=gRPCOptions(
            port=options.grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION]
        ),
    )


@contextlib.contextmanager
def proxy_environment(options: ServeOptions) -> Iterator[None]:
    """The gRPC proxy's message bound and TLS settings as environment variables while Ray
    starts: its processes inherit them from the raylet, and this process gets its own
    environment back after."""
    from deployments.router import grpc_ingress

    wanted = {GRPC_MAX_MESSAGE_ENV: str(options.grpc_max_message_bytes)}
    if options.tls:
        wanted |= {
            grpc_ingress.TLS_CERTFILE_ENV: os.path.abspath(str(options.ssl_certfile)),
            grpc_ingress.TLS_KEYFILE_ENV: os.path.abspath(str(options.ssl_keyfile)),
            grpc_ingress.TLS_PORT_ENV: str(options.grpc_tls_port),
        }
    with environment(wanted):
        yield


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while inside; what was there before (or nothing) after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Ray waits a fixed time for its GCS to publish its port and for its raylet to register; on a
# loaded 2-core machine each has been seen to miss it once in many runs (the GCS left no log at
# all). A second try, after ending what the first started, then succeeds.
_RAY_START_ATTEMPTS = 2
_RAY_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def _init_local_ray(num_cpus: int, options: ServeOptions) -> None:
    import psutil
    import ray

    dashboard = options.dashboard_port is not None
    before = {child.pid for child in psutil.Process().children()}
    for attempt in range(1, _RAY_START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",  # always a fresh local cluster, never one found on the machine
                num_cpus=num_cpus,
                include_dashboard=dashboard,
                dashboard_host=options.host,
                dashboard_port=options.dashboard_port if dashboard else None,
                _metrics_export_port=options.metrics_export_port,
                logging_level=logging.WARNING,
            )
            _ray_roots[:] = _children_since(before)
            return
        except Exception as exc:  # Ray raises a bare Exception (or RuntimeError) for these
            timed_out = any(text in str(exc) for text in _RAY_START_TIMEOUTS)
            if not timed_out or attempt == _RAY_START_ATTEMPTS:
                raise
            logger.warning("Ray's node did not start in time; starting it again")
            ray.shutdown()
            _ray_roots[:] = _children_since(before)
            _end(_ray_processes())


def stop() -> None:
    """Shut Serve and Ray down, and wait for every process Ray started to be gone."""
    import ray
    from ray import serve

    # Ray's agents are the raylet's children: ray.shutdown() ends the raylet, and they would
    # notice only minutes later, still listening. Whatever of our process tree outlives the
    # shutdown is ended here, so SIGTERM leaves as little behind as Ctrl-C does.
    ray_processes = _ray_processes()
    # Only a Ray this process is connected to: with none (its start failed), serve.shutdown()
    # would connect to whatever cluster RAY_ADDRESS names, or start one, to shut it down.
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    _end(ray_processes)


def _end(processes: list[Any]) -> None:
    """Wait for `processes` to exit; SIGTERM, then SIGKILL, what does not in time."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=_GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(alive, timeout=_GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


_GRACE_S = 5.0  # how long Ray's processes get to end on their own, then after SIGTERM
# The processes ray.init() started here (GCS, raylet, dashboard, log monitor, ...): the roots of
# Ray's process tree, told apart from any other child of this process by when they appeared.
_ray_roots: list[Any] = []


def _children_since(before: set[int]) -> list[Any]:
    """This process's children that were not among `before` (pids): what ray.init started."""
    import psutil

    return [child for child in psutil.Process().children() if child.pid not in before]


def _ray_processes() -> list[Any]:
    import psutil

    found = []
    for root in _ray_roots:
        with contextlib.suppress(psutil.Error):
            found += [root, *root.children(recursive=True)]
    _ray_roots.clear()
    return found


def run_until_interrupted(config: AppConfig, options: ServeOptions) -> None:
    stopping = threading.Event()

    def on_stop_signal(*_: Any) -> None:
        stopping.set()

    def handle_stop_signals() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_stop_signal)

    handle_stop_signals()
    try:
        # ray.init() puts its own SIGTERM handler in place (and Ray's core worker one that
        # aborts the process): SIGTERM must stop us as Ctrl-C does, so ours goes back at once
        # (a signal during the engines' start-up then stops us once the deploy returns).
        where = start(config, options, after_ray_init=handle_stop_signals)
        mode = "colocated" if config.colocated else f"disaggregated over {config.transport}"
        print(
            f"pdserve: serving model {config.model!r} ({mode}); "
            f"gRPC on {where['grpc']}, HTTP on {where['http']}"
            + (f", gRPC over TLS on {where['grpc_tls']}" if "grpc_tls" in where else "")
            + "".join(f", app {n!r} at {where[f'{n}_http']}" for n in options.extra_apps),
            flush=True,
        )
        if "dashboard" in where:
            # Ray 2.60 turns token authentication on for a new local cluster (its token in
            # ~/.ray/auth_token); Serve's CLI reads the token only when told the mode.
            print(
                f"pdserve: Ray dashboard on {where['dashboard']}; Serve's CLI: "
                f"RAY_AUTH_MODE=token serve status --address {where['dashboard']}",
                flush=True,
            )
        if "metrics" in where:
            print(f"pdserve: Prometheus metrics on {where['metrics']}", flush=True)
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
