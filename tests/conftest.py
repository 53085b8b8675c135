"""Session-wide test set-up."""

from __future__ import annotations

import contextlib
import os
import tempfile

# The default model is built once per test session into a private cache, never into ~/.cache:
# tests stay hermetic, and subprocesses (CLI tests) inherit the variable.
os.environ.setdefault(
    "PDSERVE_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"pdserve-test-cache-{os.getuid()}")
)


def pytest_sessionstart(session) -> None:
    """Compile the CPU attention kernel once, up front, into the session cache: engine
    subprocesses and Ray replicas then load it instead of racing to build it under their
    start-up timeouts. A machine that cannot build it falls back (and
    tests/unit/test_attention_backends.py says so)."""
    from engine.layers.attention.cpu import KernelBuildError, load_kernel

    with contextlib.suppress(KernelBuildError):
        load_kernel()
