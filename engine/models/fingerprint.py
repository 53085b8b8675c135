"""A fingerprint of a checkpoint's weights, for the KV compatibility hash: two engines whose
weights differ (another revision, another fine-tune, another quantization of the same
architecture) compute different KV for the same tokens, and must refuse to exchange it.

Hashing every byte of a multi-gigabyte checkpoint at start-up would cost seconds; the
fingerprint hashes what tells checkpoints apart at a fixed cost of ~3 MiB read per file: its
size, its head (a GGUF's metadata and tensor table, a safetensors header) and 32 evenly spaced
64 KiB samples of its data and its tail. Any retrained or requantized checkpoint differs in
nearly every sample; one that differed in a single tensor that no sample touches would be
missed (say so where it matters: the block checksums still catch transport faults, not a
silently different model).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from engine.models.catalog import DOWNLOAD_MARKER, is_gguf_path
from engine.models.loader import safetensors_files

_HEAD_BYTES = 1 << 20
_SAMPLE_BYTES = 64 << 10
_NUM_SAMPLES = 32


def weights_fingerprint(path: str) -> str:
    """sha256 hex over the checkpoint at `path` (a .gguf file, or a directory of config.json
    and safetensors), and the Hub revision `pdserve download` recorded there, if any; the same
    on every machine that holds the same files from the same revision."""
    files = [Path(path)] if is_gguf_path(path) else _directory_files(Path(path))
    digest = hashlib.sha256()
    revision = downloaded_revision(Path(path))
    if revision:
        digest.update(b"revision\0" + revision.encode() + b"\0")
    for file in files:
        stat = file.stat()
        digest.update(file.name.encode() + b"\0")
        digest.update(bytes.fromhex(_file_fingerprint(str(file), stat.st_size, stat.st_mtime_ns)))
    return digest.hexdigest()


def dummy_weights_fingerprint(path: str, device_kind: str, tensor_parallel_size: int) -> str:
    """The fingerprint of load_format="dummy" weights: drawn from a fixed seed per kind of
    device (CPU and CUDA generators differ, and CUDA's with the GPU's multiprocessor count) and
    per rank's slice (each rank draws its own), so two dummy engines hold the same weights
    only where config, `device_kind` and TP size agree."""
    config = Path(path) / "config.json"  # dummy weights need no other file
    stat = config.stat()
    digest = hashlib.sha256(b"dummy\0")
    digest.update(bytes.fromhex(_file_fingerprint(str(config), stat.st_size, stat.st_mtime_ns)))
    digest.update(f"\0{device_kind}\0{tensor_parallel_size}".encode())
    return digest.hexdigest()


def downloaded_revision(path: Path) -> str:
    """The Hub revision `pdserve download` fetched into `path`'s directory ("" if none)."""
    marker = (path.parent if path.is_file() else path) / DOWNLOAD_MARKER
    try:
        return str(json.loads(marker.read_text()).get("revision") or "")
    except (OSError, ValueError):
        return ""


def _directory_files(path: Path) -> list[Path]:
    config = path / "config.json"
    return ([config] if config.is_file() else []) + safetensors_files(path)


@functools.lru_cache(maxsize=64)
def _file_fingerprint(path: str, size: int, mtime_ns: int) -> str:
    """Keyed by size and mtime too: a file replaced in place is read again."""
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        digest.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            step = max(_SAMPLE_BYTES, (size - _HEAD_BYTES) // _NUM_SAMPLES)
            for offset in range(_HEAD_BYTES, size, step):
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(_HEAD_BYTES, size - _SAMPLE_BYTES), os.SEEK_SET)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
