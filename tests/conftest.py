"""Session-wide test set-up."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

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


def pytest_sessionstart(session) -> None:
    """Compile the CPU kernels once, up front, into the session cache: engine subprocesses and
    Ray replicas then load them instead of racing to build them under their start-up timeouts.
    A machine that cannot build them falls back (and tests/unit/test_attention_backends.py,
    test_linear.py and test_fused_decode.py say so)."""
    from engine.layers import cpu_kernels

    with contextlib.suppress(cpu_kernels.KernelBuildError):
        cpu_kernels.load()
