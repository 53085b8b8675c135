"""`pdserve drain-node`: a Ray worker pod's preStop hook — move Serve's work off this node
before Kubernetes stops it.

An evicted or scaled-down pod gets SIGTERM and, after its grace period, SIGKILL; Ray on its own
notices the node's loss only then, and every stream on it fails at once. Instead the hook asks
Ray's GCS to drain this node (`ray drain-node`, reason preemption, with the deadline the pod
has): Serve starts the node's replicas elsewhere and stops these gracefully (an engine finishes
or migrates its streams, engine_server's drain), and the hook returns once no Serve replica
runs here, or at the deadline, whichever comes first. Then Kubernetes stops the container.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Ray names a Serve replica's worker process after it ("ray::ServeReplica:app:Deployment").
REPLICA_PROCESS = "ray::ServeReplica"
_POLL_S = 1.0


@dataclass
class DrainOptions:
    """`pdserve drain-node`'s flags (pdserve/flags.py)."""

    deadline_s: float = 300.0
    """how long the pod has (its terminationGracePeriodSeconds, less a margin)"""


def drain_command(deadline_s: float) -> list[str]:
    return [
        "ray",
        "drain-node",
        "--reason",
        "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message",
        "the pod is being stopped (preStop)",
        "--deadline-remaining-seconds",
        str(int(deadline_s)),
    ]


def replicas_here() -> int:
    """Serve replica processes on this node."""
    import psutil

    count = 0
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        count += any(part.startswith(REPLICA_PROCESS) for part in cmdline)
    return count


def _run_bounded(args: list[str], timeout_s: float) -> int:
    """The command's exit status; 1 where it outlived `timeout_s` (`ray drain-node` waits for
    an unreachable head without end)."""
    try:
        return subprocess.run(args, check=False, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        return 1


def drain(
    deadline_s: float,
    run: Callable[[list[str]], int] | None = None,
    replicas: Callable[[], int] = replicas_here,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], None] = time.sleep,
) -> bool:
    """Ask Ray to drain this node, then wait until no replica runs here (True) or the deadline
    passes (False). A refused drain (no Ray here, an old Ray) still waits: Serve's own
    shutdown of the replicas may yet end them."""
    end = clock() + deadline_s
    if run is None:
        run = lambda args: _run_bounded(args, deadline_s)  # noqa: E731
    if run(drain_command(deadline_s)) != 0:
        logger.warning("ray drain-node failed; waiting for the replicas to end on their own")
    while replicas() > 0:
        if clock() >= end:
            logger.warning("deadline reached with Serve replicas still on this node")
            return False
        wait(_POLL_S)
    return True


def run(options: DrainOptions) -> int:
    if options.deadline_s <= 0:
        raise ValueError(f"deadline_s must be > 0, got {options.deadline_s}")
    drain(options.deadline_s)
    return 0  # a preStop hook that fails is only logged by the kubelet: say it in our log
