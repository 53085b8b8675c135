"""Session-wide test set-up."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The tests that start Ray: those on the Serve harness (tests/integration/serving.py) and the one
# that starts its own (`pdserve serve`). Under `make test`'s two workers they all run on one, in the
# order tests/integration/conftest.py gives them: one Ray on the machine at a time.
# tests/integration/conftest.py refuses a test that starts Ray from elsewhere.
RAY_TESTS = tuple(
    f"tests/integration/{path}"
    for path in (
        "serve_app/",
        "test_kv_routing.py",
        "test_migration_serve.py",
        "test_security_serve.py",
        "test_serve_cli.py",
        "test_sla_autoscaling_serve.py",
        "test_startup_serve.py",
        "test_tp_serve.py",
        "test_tracing.py",
    )
)

# pytest-xdist's workers share the machine's cores: each computes on its share, and so do the
# engines and CLI processes it starts (they inherit the variable; Ray's engine replicas set their
# own from their CPUs). Two torch thread pools per core spin against each other: tried here, two
# concurrent 2-thread engines took twice as long as two 1-thread ones. The kernels' own tests
# take two threads back (`two_threads`), so their work-splitting is still exercised.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

# The default model is built once per test session into a private cache, never into ~/.cache:
# tests stay hermetic, and subprocesses (CLI tests) inherit the variable. One per checkout: the
# CPU kernels' build files record their sources' path, so checkouts sharing a cache would each
# rebuild the kernels (minutes) whenever another had built them.
_CHECKOUT = hashlib.sha256(str(Path(__file__).resolve().parents[1]).encode()).hexdigest()[:8]
os.environ.setdefault(
    "PDSERVE_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"pdserve-test-cache-{os.getuid()}-{_CHECKOUT}"),
)


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the model tests run their engines (cuda: the parity suite on a GPU)",
    )


def pytest_configure(config) -> None:
    if config.getoption("--device") == "cpu":
        # The suite's expectations are the CPU's (float32 by default, the CPU kernels): an
        # engine left at device="auto", or a Ray replica, must not land on a GPU the machine
        # happens to have. Torch initialises CUDA lazily, so this still takes effect.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # The Triton kernels (engine/layers/gpu/) run on the CPU in Triton's interpreter, which
        # Triton picks when a kernel is defined: set before any test imports them.
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_sessionstart(session) -> None:
    """Compile the CPU kernels once, up front, into the session cache: engine subprocesses and
    Ray replicas then load them instead of racing to build them under their start-up timeouts.
    A machine that cannot build them falls back (and tests/unit/test_attention_backends.py,
    test_linear.py and test_fused_decode.py say so)."""
    if session.config.getoption("--device") != "cpu":
        return  # the GPU runs (`pdserve bench gpu`) need none of them
    from engine.layers import cpu_kernels

    with contextlib.suppress(cpu_kernels.KernelBuildError):
        cpu_kernels.load()


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Torch's intra-op pool at two threads for the test: the CPU kernels split their work
    between threads (one thread would leave that code unrun)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """pytest-xdist's scheduling by scope, with every Ray test in one scope ("ray", given to
    one worker whole) and each other test a scope of its own (shared out as workers free up).
    The scope is all the scheduler sees of a test: its node id."""
    from xdist.scheduler import LoadScopeScheduling

    class OneRayAtATime(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if nodeid.startswith(RAY_TESTS) else nodeid

    return OneRayAtATime(config, log)
