"""Where pdserve keeps what it builds on first use (the default model, CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"


def pdserve_cache_dir() -> Path:
    """`$PDSERVE_CACHE_DIR`, else ~/.cache/pdserve."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pdserve").expanduser()
