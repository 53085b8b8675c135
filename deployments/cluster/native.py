"""The cluster's C code (csrc/), compiled on first use with the machine's C compiler into the
pdserve cache, and imported from there.

Router and index processes import no torch (tests/unit/test_layout.py), so this does not go
through torch's extension builder as the engine's kernels do (engine/layers/cpu_kernels.py):
one C file, one `cc` call, a CPython extension module. A build is keyed by the source, the
interpreter (its version and ABI) and the flags, and taken under a lock across processes.
Callers fall back to their Python implementation on `NativeBuildError` (no compiler, no
Python headers, or `PDSERVE_NATIVE=0`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from engine.cache_dir import exclusive_lock, pdserve_cache_dir

SOURCES = Path(__file__).parent / "csrc"
# NDEBUG as CPython's own release builds have it: the headers' assertions are checks of
# CPython's internals, not of these modules' inputs.
CFLAGS = ["-O2", "-DNDEBUG", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall"]
DISABLE_ENV = "PDSERVE_NATIVE"  # "0": never build or load (the Python implementations run)


class NativeBuildError(RuntimeError):
    """The module cannot be built or loaded here."""


@functools.cache
def load(name: str) -> ModuleType:
    """Build (once per machine) and import `pdserve_<name>` from csrc/<name>.c."""
    if os.environ.get(DISABLE_ENV) == "0":
        raise NativeBuildError(f"{DISABLE_ENV}=0")
    source = SOURCES / f"{name}.c"
    module = f"pdserve_{name}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    include = sysconfig.get_paths()["include"]
    compiler = _compiler()
    key = hashlib.sha256(source.read_bytes())
    for header in sorted(SOURCES.glob("*.h")):  # what the sources include
        key.update(header.read_bytes())
    for part in (sys.version, suffix, include, *compiler, *CFLAGS):
        key.update(part.encode())
    directory = pdserve_cache_dir() / "native" / f"{name}-{key.hexdigest()[:16]}"
    built = directory / f"{module}{suffix}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(directory / "build.lock"):
            if not built.exists():
                _build(compiler, source, include, built)
    except (OSError, subprocess.SubprocessError) as exc:  # a read-only cache, a hung compiler
        raise NativeBuildError(f"cannot build {source.name}: {exc}") from exc
    spec = importlib.util.spec_from_file_location(module, built)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"cannot load {built.name}")
    try:
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    except ImportError as exc:
        raise NativeBuildError(f"cannot load {built.name}: {exc}") from exc
    return loaded


def _compiler() -> list[str]:
    """$CC, else the interpreter's compiler, else `cc` (as setuptools would pick)."""
    configured = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    command = shlex.split(configured)
    if not command or shutil.which(command[0]) is None:
        raise NativeBuildError(f"no C compiler ({configured!r} is not on PATH)")
    return command


def _build(compiler: list[str], source: Path, include: str, built: Path) -> None:
    if not (Path(include) / "Python.h").exists():
        raise NativeBuildError("no Python headers (Python.h) for this interpreter")
    partial = built.with_suffix(".partial")
    command = [*compiler, *CFLAGS, f"-I{include}", str(source), "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise NativeBuildError(f"{source.name} did not compile: {detail[0]}")
    partial.replace(built)  # whole or not at all: a killed build leaves no half module
