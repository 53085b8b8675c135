"""Session-wide test set-up."""

from __future__ import annotations

import os
import tempfile

# The default model is built once per test session into a private cache, never into ~/.cache:
# tests stay hermetic, and subprocesses (CLI tests) inherit the variable.
os.environ.setdefault(
    "PDSERVE_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"pdserve-test-cache-{os.getuid()}")
)
