"""Where pdserve keeps what it builds on first use (the default model, CPU kernels), and the
lock that keeps two processes from building the same thing at once."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"


def pdserve_cache_dir() -> Path:
    """`$PDSERVE_CACHE_DIR`, else ~/.cache/pdserve."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pdserve").expanduser()


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """An flock on `lock_path` (created if missing): one holder across processes, released
    when the holder exits however it exits."""
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
