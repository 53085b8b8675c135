"""CPU fast path: decodes read the paged KV cache in place through a small C++ kernel.

The kernel (csrc/paged_decode.cpp) is compiled on first use with torch's JIT extension builder
and cached per machine (the build directory is keyed by the source, torch's version and the CPU's
instruction-set flags, since it is built with -march=native). Prefills keep the reference path:
SDPA's blocked CPU kernel is already GEMM-shaped there. Building needs a C++ compiler and
ninja; when that fails, `get_attention_backend("auto", cpu)` falls back to the reference.
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
from engine.layers.attention.backend import AttentionMetadata
from engine.layers.attention.torch_ref import TorchReferenceBackend

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded on this machine."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_directory() -> Path:
    """Under the pdserve cache, one directory per (source, torch, CPU features)."""
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode()):
        key.update(part)
    for flag in _CFLAGS:
        key.update(flag.encode())
    return pdserve_cache_dir() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}"


@functools.cache
def load_kernel() -> ModuleType:
    """Compile (once per machine) and import the kernel; KernelBuildError when impossible."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(directory):
            return cpp_extension.load(
                name="pdserve_paged_decode",
                sources=[str(_SOURCE)],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # compiler, ninja or loader errors all mean "not here"
        raise KernelBuildError(f"cannot build the CPU attention kernel: {exc}") from exc


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


class CpuBackend(TorchReferenceBackend):
    def __init__(self) -> None:
        self.kernel = load_kernel()

    def _write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> None:
        self.kernel.write_kv(kv_cache, k, v, md.slot_block, md.slot_offset)

    def _decodes(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        only_decodes = md.num_decodes == md.num_tokens  # token i is decode i: no gather
        queries = q if only_decodes else q[md.decode_token_indices]
        attended = out if only_decodes else torch.empty_like(queries)
        self.kernel.paged_decode_attention(
            attended,
            queries,
            kv_cache,
            md.decode_block_table,
            md.decode_seq_lens,
            md.sliding_window or 0,
            scale,
        )
        if not only_decodes:
            out[md.decode_token_indices] = attended
