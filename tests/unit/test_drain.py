"""`pdserve drain-node` (pdserve/drain.py), a GPU pod's preStop hook. Ray's drain call stands
in as a recorded command (no Kubernetes or multi-node Ray here); the replica count is read from
real processes named as Ray names a Serve replica's worker."""

from __future__ import annotations

import subprocess

import pytest

from pdserve.drain import DrainOptions, _run_bounded, drain, drain_command, replicas_here, run
from tests.waiting import wait_until


def test_replicas_are_counted_by_their_process_name() -> None:
    before = replicas_here()
    # A process that runs until killed, named as Ray names a replica's worker.
    named = "exec -a 'ray::ServeReplica:pdserve:DecodeServer' tail -f /dev/null"
    process = subprocess.Popen(["bash", "-c", named])
    try:
        assert wait_until(lambda: replicas_here() == before + 1, timeout_s=10)
    finally:
        process.kill()
        process.wait()
    assert wait_until(lambda: replicas_here() == before, timeout_s=10)


def test_drain_asks_ray_then_waits_for_the_replicas_to_leave() -> None:
    commands: list[list[str]] = []
    left = [2, 2, 1, 0]
    now = [0.0]
    done = drain(
        300,
        run=lambda args: commands.append(args) or 0,
        replicas=lambda: left.pop(0),
        clock=lambda: now[0],
        wait=lambda s: now.__setitem__(0, now[0] + s),
    )
    assert done and commands == [drain_command(300)] and not left
    assert commands[0][:2] == ["ray", "drain-node"]
    assert "DRAIN_NODE_REASON_PREEMPTION" in commands[0] and commands[0][-1] == "300"


def test_drain_gives_up_at_the_deadline_even_when_ray_refused() -> None:
    now = [0.0]
    done = drain(
        5,
        run=lambda args: 1,  # no Ray on this node, or one too old for drain-node
        replicas=lambda: 1,
        clock=lambda: now[0],
        wait=lambda s: now.__setitem__(0, now[0] + s),
    )
    assert not done and now[0] == pytest.approx(5.0)


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="deadline_s must be > 0"):
        run(DrainOptions(deadline_s=0))


def test_a_drain_command_that_hangs_is_bounded_by_the_deadline() -> None:
    """`ray drain-node` waits without end for an unreachable head: the hook must not."""
    assert _run_bounded(["tail", "-f", "/dev/null"], timeout_s=0.5) == 1  # never ends
    assert _run_bounded(["true"], timeout_s=5) == 0
