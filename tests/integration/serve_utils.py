"""Helpers for tests that run the Serve app on local Ray."""

from __future__ import annotations

import time
from collections.abc import Callable

from deployments.launch import free_port

__all__ = ["free_port", "replica_actors", "sigkill_replica", "wait_until"]


def wait_until(condition: Callable[[], bool], timeout_s: float, period_s: float = 0.25) -> bool:
    """Poll `condition` (exceptions count as False) until it holds or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return True
        except Exception:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(period_s)


def replica_actors(deployment: str, app_name: str = "pdserve") -> list[str]:
    """Names of the live replica actors of a deployment (e.g. "PrefillServer") of `app_name`
    (namespace "serve")."""
    import ray

    return sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve"
        and actor["name"].startswith(f"SERVE_REPLICA::{app_name}#{deployment}#")
    )


def sigkill_replica(actor_name: str) -> int:
    """SIGKILL a replica actor's process (a crash, the kernel's OOM killer): no clean-up runs
    in it. Its pid comes from the GCS actor table (Ray's private state API: the public one
    needs the dashboard, which these tests leave off)."""
    import os
    import signal

    from ray._private import state

    (entry,) = [
        actor
        for actor in state.actors().values()
        if actor.get("Name") == actor_name and actor.get("State") == "ALIVE"
    ]
    pid = int(entry["Pid"])
    os.kill(pid, signal.SIGKILL)
    return pid
