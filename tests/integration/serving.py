"""The integration suite's Serve harness: one local Ray and Serve (started with
deployments.launch's machinery) for every test module that serves an app, the apps deployed and
deleted per module (or per package, tests/integration/serve_app/), and the ways a test calls
them: gRPC (pdserve.client), HTTP, health and engines-idle checks, the replicas' logs.

Starting Ray and Serve costs tens of seconds on 2 cores and an app most of a minute: the
cluster starts once, and again only for proxies of other settings (TLS); see conftest.py.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments import launch
from deployments.app_config import AppConfig
from deployments.cluster.kv_index import index_actor_name
from deployments.launch import APP_NAME, ServeOptions, free_port
from pdserve.client import GenerationClient

__all__ = [
    "APP_NAME",
    "AppSettings",
    "ProxyTLS",
    "ServeCluster",
    "ServedApp",
    "free_port",
    "ongoing_requests",
    "replica_actors",
    "replica_metadata",
    "running_replicas",
    "sigkill_replica",
]

# Ray's logical CPUs: enough for the largest app deployed here (4 engines of 1 CPU, routers),
# and for replacements of killed replicas. Cores are shared whatever the number.
NUM_CPUS = 16
HTTP_TIMEOUT_S = 120


@dataclass(frozen=True)
class ProxyTLS:
    """PEM files for Serve's HTTPS and the gRPC proxy's TLS port."""

    keyfile: str
    certfile: str


@dataclass
class AppSettings:
    """What a module serves: the main app ("pdserve", at route /) as AppConfig overrides, apps
    beside it (name -> overrides of the main app's settings, at route /<name>), and TLS at
    the proxies."""

    app: dict[str, Any]
    extra_apps: dict[str, dict[str, Any]] = field(default_factory=dict)
    tls: ProxyTLS | None = None


class ServeCluster:
    """Local Ray and Serve for the session, started when an app is first wanted; started
    again when the proxies' TLS differs (the gRPC proxy reads it from the environment that
    Ray's processes inherit). `environment`: variables every Ray process gets."""

    def __init__(self, environment: dict[str, str]) -> None:
        self._environment = environment
        self._options: ServeOptions | None = None

    @contextlib.contextmanager
    def serving(self, settings: AppSettings, wait: bool = True) -> Iterator[ServedApp]:
        """The apps of `settings`, deployed and (`wait`) running; deleted on exit."""
        served = ServedApp(self._ensure(settings.tls), settings)
        try:
            served.deploy(wait)
            yield served
        finally:
            served.delete()

    def stop(self) -> None:
        """Shut Serve and Ray down, and wait for their processes to be gone."""
        if self._options is not None:
            self._options = None
            launch.stop()

    def _ensure(self, tls: ProxyTLS | None) -> ServeOptions:
        if self._options is not None and _tls_of(self._options) != tls:
            self.stop()
        if self._options is None:
            self._options = self._start(tls)
        return self._options

    def _start(self, tls: ProxyTLS | None) -> ServeOptions:
        """As `pdserve serve` starts (deployments.launch.start), without deploying."""

        options = ServeOptions(
            grpc_port=free_port(),
            http_port=free_port(),
            num_cpus=NUM_CPUS,
            ssl_keyfile=tls.keyfile if tls else None,
            ssl_certfile=tls.certfile if tls else None,
            grpc_tls_port=free_port(),
        )
        with launch.environment(self._environment), launch.proxy_environment(options):
            launch._init_local_ray(NUM_CPUS, options)
        try:
            launch.start_serve(options)
        except BaseException:
            launch.stop()  # no Ray left behind for the next module to trip over
            raise
        return options


def _tls_of(options: ServeOptions) -> ProxyTLS | None:
    if not options.tls:
        return None
    return ProxyTLS(str(options.ssl_keyfile), str(options.ssl_certfile))


class ServedApp:
    """The apps of one AppSettings on the session's Serve, deployed as `pdserve serve`
    deploys them (deployments.launch.start): the main app at route /, each extra app at
    /<name> and by its name in gRPC metadata."""

    def __init__(self, options: ServeOptions, settings: AppSettings) -> None:
        self.settings = settings
        self.grpc_port, self.http_port = options.grpc_port, options.http_port
        self.grpc_tls_port = options.grpc_tls_port
        self.target = f"{options.host}:{options.grpc_port}"
        # Over TLS by name: the proxy's certificate names "localhost", not an address.
        host = "localhost" if options.tls else options.host
        self.http_url = f"{'https' if options.tls else 'http'}://{host}:{options.http_port}"
        self.names = [APP_NAME, *settings.extra_apps]
        self.clients = {name: GenerationClient(self.target, name) for name in self.names}
        self.client = self.clients[APP_NAME]
        self._logs_before: set[Path] = set()

    def deploy(self, wait: bool = True) -> None:
        self._logs_before = set(_serve_logs().glob("*"))
        launch.deploy(AppConfig.from_args(self.settings.app), self.settings.extra_apps, wait)

    def delete(self) -> None:
        """Delete the apps, and their KV index actors (detached: `serve.shutdown()` would end
        them, a deleted app leaves them for the next app of its name)."""
        import ray
        from ray import serve

        for client in self.clients.values():
            client.close()
        processes = _processes_of(self.names)
        for name in reversed(self.names):
            serve.delete(name)
            with contextlib.suppress(ValueError):  # none was made
                ray.kill(ray.get_actor(index_actor_name(name), namespace="pdserve"))
        # Gone, not going: the next app's tests count processes and cores.
        launch._end(processes)

    # ---------------------------------------------------------------------------- gRPC

    def grpc(
        self, app: str = APP_NAME, api_key: str = "", roots: bytes | None = None
    ) -> GenerationClient:
        """A client of its own (the caller closes it): with a key, or over TLS to the
        proxy's TLS port trusting `roots` (b"": the system's)."""
        if roots is None:
            return GenerationClient(self.target, app, api_key)
        return GenerationClient(f"localhost:{self.grpc_tls_port}", app, api_key, roots)

    def engines_idle(self, app: str = APP_NAME) -> bool:
        """Every engine of `app` running, every block free, no request anywhere."""
        health = self.clients[app].health()
        return health.status == "SERVING" and all(
            e.state == "running"
            and e.num_free_blocks == e.num_blocks
            and e.num_running == 0
            and e.num_waiting == 0
            and e.num_held_requests == 0
            for e in health.engines
        )

    # ---------------------------------------------------------------------------- HTTP

    def connection(self, timeout: float = HTTP_TIMEOUT_S) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)

    def request(
        self,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], str]:
        """POST a JSON body (or `raw` bytes): status, headers (lower-case names), text."""
        conn = self.connection()
        payload = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, payload, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, text

    def http(
        self, path: str, body: Any, raw: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """POST, and the reply's JSON."""
        status, _, text = self.request(path, body, raw, headers)
        return status, json.loads(text)

    def sse(self, path: str, body: dict[str, Any]) -> list[Any]:
        """A streamed call's server-sent events: JSON objects, then "[DONE]"."""
        conn = self.connection()
        conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        events = []
        for line in response:
            text = line.decode().strip()
            if text.startswith("data: "):
                data = text[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
        conn.close()
        return events

    # ---------------------------------------------------------------------------- Ray

    def replicas(self, deployment: str, app: str = APP_NAME) -> list[str]:
        return replica_actors(deployment, app)

    def logs(self, pattern: str) -> str:
        """The text of Serve's log files matching `pattern` (e.g. "replica_pdserve_Router_*")
        written by this deployment's processes: none an earlier app on this Ray left."""
        return "".join(
            path.read_text(errors="replace")
            for path in sorted(_serve_logs().glob(pattern))
            if path not in self._logs_before
        )


def _serve_logs() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"


def _processes_of(apps: list[str]) -> list[Any]:
    """The processes of the apps' replica actors and KV index actors."""
    import psutil
    from ray._private import state

    names = {index_actor_name(app) for app in apps}
    prefixes = tuple(f"SERVE_REPLICA::{app}#" for app in apps)
    processes = []
    for actor in state.actors().values():
        name = actor.get("Name") or ""
        if actor.get("State") == "ALIVE" and (name in names or name.startswith(prefixes)):
            with contextlib.suppress(psutil.Error):
                processes.append(psutil.Process(int(actor["Pid"])))
    return processes


def running_replicas(deployment: str, app_name: str = APP_NAME) -> int:
    """Replicas of a deployment (e.g. "DecodeServer") of `app_name` that Serve reports
    RUNNING: started and past their first health check."""
    from ray import serve

    status = serve.status().applications[app_name].deployments[deployment]
    return int(status.replica_states.get("RUNNING", 0))


def replica_actors(deployment: str, app_name: str = APP_NAME) -> list[str]:
    """Names of the live replica actors of a deployment (e.g. "PrefillServer") of `app_name`
    (namespace "serve")."""
    import ray

    return sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve"
        and actor["name"].startswith(f"SERVE_REPLICA::{app_name}#{deployment}#")
    )


def replica_metadata(deployment: str, app_name: str = APP_NAME) -> list[dict[str, Any]]:
    """What Serve's controller holds of each running replica's `record_replica_metadata` (and
    gives to request routers). Serve's testing hook: no public API lists it."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    dump = controller._dump_replica_states_for_testing.remote(DeploymentID(deployment, app_name))
    return [replica.replica_metadata for replica in ray.get(dump, timeout=30).get()]


def ongoing_requests(actor_name: str) -> int:
    """Requests a replica is handling now, as Serve counts them (for its routing and its
    max_ongoing_requests): a request counts from its arrival at the replica."""
    import ray

    actor = ray.get_actor(actor_name, namespace="serve")
    return int(ray.get(actor.get_num_ongoing_requests.remote(), timeout=10))


def replica_pid(actor_name: str) -> int:
    """A live replica actor's process id, from the GCS actor table (Ray's private state API:
    the public one needs the dashboard, which these tests leave off). The query can take
    seconds on a loaded machine: a test that must kill at a moment looks the pid up first."""
    from ray._private import state

    (entry,) = [
        actor
        for actor in state.actors().values()
        if actor.get("Name") == actor_name and actor.get("State") == "ALIVE"
    ]
    return int(entry["Pid"])


def sigkill_replica(actor_name: str) -> int:
    """SIGKILL a replica actor's process (a crash, the kernel's OOM killer): no clean-up runs
    in it."""
    pid = replica_pid(actor_name)
    os.kill(pid, signal.SIGKILL)
    return pid
