"""The C++ kernels for CPUs, one module compiled on first use with torch's JIT extension builder.

csrc/cpu_ops.cpp includes the kernels (paged attention, dense linears, the fused decode step);
the module is built once per machine and cached under the pdserve cache: the build directory
is keyed by every file in csrc/, torch's version, the flags and the CPU's instruction-set
flags (kernels are built with -march=native). Building needs a C++ compiler and ninja; callers
fall back to plain torch on `KernelBuildError`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from engine.cache_dir import exclusive_lock, pdserve_cache_dir

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]


class KernelBuildError(RuntimeError):
    """A C++ kernel could not be compiled or loaded on this machine."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


SOURCES = Path(__file__).parent / "csrc"
_NAME = "cpu_ops"


def build_directory() -> Path:
    """Under the pdserve cache, one directory per (sources, torch, flags, CPU features)."""
    key = hashlib.sha256()
    for path in sorted(SOURCES.glob("*.[ch]*")):  # the headers too: cpu_ops.cpp includes them
        key.update(path.name.encode())
        key.update(path.read_bytes())
    for part in (torch.__version__, _cpu_flags(), *CFLAGS):
        key.update(part.encode())
    return pdserve_cache_dir() / "kernels" / f"{_NAME}-{key.hexdigest()[:16]}"


@functools.cache
def load() -> ModuleType:
    """Compile (once per machine) and import the kernel module; KernelBuildError when that is
    impossible here."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(directory):
            return cpp_extension.load(
                name=f"pdserve_{_NAME}",
                sources=[str(SOURCES / f"{_NAME}.cpp")],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # compiler, ninja or loader errors all mean "not here"
        raise KernelBuildError(f"cannot build the CPU kernels: {exc}") from exc


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One builder per directory across processes. torch's own lock is a file that a process
    killed mid-build leaves behind, after which every later load waits forever; an flock dies
    with its holder, and whoever holds it may clear torch's stale file."""
    with exclusive_lock(directory / "pdserve.lock"):
        with contextlib.suppress(FileNotFoundError):
            (directory / "lock").unlink()  # torch's FileBaton file: stale, we hold the lock
        yield


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel installs it next to this interpreter,
    which is not on PATH when the venv is not activated (Ray workers, `.venv/bin/pdserve`)."""
    directories = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError):
        import ninja

        directories.append(ninja.BIN_DIR)
    path = os.environ.get("PATH", "")
    missing = [d for d in directories if d not in path.split(os.pathsep)]
    if missing:
        os.environ["PATH"] = os.pathsep.join([*missing, path])
