"""`pdserve download` (the manifest's init container): named models are copied in, Hub repos
fetched (the Hub cannot be reached from the test machines: huggingface_hub's snapshot_download
is replaced by one that writes what a Hub repo holds, and the test says so), and a second run
with the same model does nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.models.catalog import resolve_model
from pdserve.cli import main
from pdserve.download import HUB_PATTERNS, HUB_PATTERNS_WITHOUT_WEIGHTS, download


def test_a_named_model_is_copied_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served = download("tiny", tmp_path / "m")
    assert served == tmp_path / "m"
    assert (served / "config.json").read_bytes() == (
        resolve_model("tiny") / "config.json"
    ).read_bytes()
    (served / "config.json").unlink()  # a second run must not copy again
    assert download("tiny", tmp_path / "m") == served
    assert not (served / "config.json").exists()


def test_a_hub_repo_is_fetched_with_only_what_the_engine_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []

    def snapshot_download(**kwargs: Any) -> str:  # stands in for the Hub (unreachable here)
        calls.append(kwargs)
        Path(kwargs["local_dir"], "config.json").write_text("{}")
        return str(kwargs["local_dir"])

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    served = download("Qwen/Qwen2.5-7B-Instruct", tmp_path / "q", revision="main")
    assert served == tmp_path / "q" and (served / "config.json").exists()
    assert calls == [
        {
            "repo_id": "Qwen/Qwen2.5-7B-Instruct",
            "revision": "main",
            "local_dir": tmp_path / "q",
            "allow_patterns": HUB_PATTERNS,
        }
    ]
    download("Qwen/Qwen2.5-7B-Instruct", tmp_path / "q", revision="main")
    assert len(calls) == 1  # already there
    (tmp_path / "q" / "model-00002-of-00002.safetensors").write_bytes(b"old shard")
    download("Qwen/Qwen2.5-7B-Instruct", tmp_path / "q", revision="v2")
    assert len(calls) == 2  # another revision is another download, into an emptied directory
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == [
        ".pdserve-download.json",
        "config.json",
    ]
    download("Qwen/Qwen2.5-7B-Instruct", tmp_path / "r", revision="v2", without_weights=True)
    assert calls[-1]["allow_patterns"] == HUB_PATTERNS_WITHOUT_WEIGHTS  # a router's pod
    assert not any(p.endswith(".safetensors") for p in HUB_PATTERNS_WITHOUT_WEIGHTS)
    download("Qwen/Qwen2.5-7B-Instruct", tmp_path / "r", revision="v2")
    assert calls[-1]["allow_patterns"] == HUB_PATTERNS  # the weights now: not "already there"


@pytest.mark.parametrize("model", ["../etc", "/models/x", "no-slash", "a/b/c", ""])
def test_anything_else_is_refused(
    tmp_path: Path, model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["download", "--model", model, "--dir", str(tmp_path)]) == 2
    assert "neither a Hugging Face repo id" in capsys.readouterr().err
