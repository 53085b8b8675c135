"""Where this process runs in Serve: its replica id, or none outside a replica (a test, a local
engine). Both the router and the engine replicas name their spans and stats by it."""

from __future__ import annotations

import os


def serve_replica_id() -> str | None:
    """This Serve replica's id; None outside a replica (tests, local use)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return None


def replica_name() -> str:
    """The replica id, or the process id where there is no replica (names spans and stats)."""
    return serve_replica_id() or f"pid-{os.getpid()}"
