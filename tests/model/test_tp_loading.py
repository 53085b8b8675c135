"""Each tensor-parallel rank loads its slice of a checkpoint: the same numbers as the whole
tensor cut there, from safetensors and from GGUF files (quantized ones dequantized a slice at
a time, never whole, where the slice starts and ends on a quantization block)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import gguf_file
from engine.models.config import ModelArchConfig
from engine.models.loader import checkpoint_tensors
from engine.parallel.layout import SKIP, TPLayout
from engine.testing.gguf_writer import write_gguf


def _whole(path: Path, arch: ModelArchConfig) -> dict[str, torch.Tensor]:
    return dict(checkpoint_tensors(path, arch))


def _check_slices(path: Path, arch: ModelArchConfig, size: int) -> None:
    whole = _whole(path, arch)
    for rank in range(size):
        layout = TPLayout(arch, rank, size)
        sliced = dict(checkpoint_tensors(path, arch, layout))
        for name, tensor in whole.items():
            where = layout.tensor_slice(name)
            if where == SKIP:
                assert name not in sliced
                continue
            if where is None:
                expected = tensor
            else:
                dim, start, stop = where  # type: ignore[misc]
                expected = tensor.narrow(dim, start, min(stop, tensor.shape[dim]) - start)
            assert torch.equal(sliced[name], expected), f"rank {rank}: {name}"


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias"])
def test_safetensors_slices_equal_the_whole_cut(hf_refs, arch):
    path = Path(hf_refs[arch].path)
    _check_slices(path, ModelArchConfig.from_pretrained(path), 2)


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0", "Q4_1"])
def test_gguf_slices_are_dequantized_alone(hf_refs, tmp_path, monkeypatch, tensor_type):
    # llama: q/k rows in llama.cpp's order, un-permuted per rank's heads.
    gguf_path = write_gguf(Path(hf_refs["llama_gqa"].path), tmp_path / "m.gguf", tensor_type)
    arch = ModelArchConfig.from_pretrained(gguf_path)
    whole_reads: list[str] = []
    real = gguf_file._dequantize

    def counting(tensor, name):
        whole_reads.append(tensor.name)
        return real(tensor, name)

    monkeypatch.setattr(gguf_file, "_dequantize", counting)
    # 2 ranks: o_proj's 32 and down_proj's 64 columns per rank start on 32-wide blocks.
    _check_slices(gguf_path, arch, 2)
    per_rank = [n for n in whole_reads if "norm" not in n]
    whole_reads.clear()
    layout = TPLayout(arch, 1, 2)
    list(checkpoint_tensors(gguf_path, arch, layout))
    assert [n for n in whole_reads if "norm" not in n] == [], "a rank dequantized a whole matrix"
    assert per_rank  # _check_slices' reference loads did read whole tensors (the hook works)
    # 4 ranks: o_proj's 16 columns cut a quantization block: dequantized whole, then cut.
    _check_slices(gguf_path, arch, 4)


def test_gguf_biases_are_sliced_with_their_rows(hf_refs, tmp_path):
    # Qwen2: q, k and v carry biases (1-D tensors), split like their matrices' rows.
    gguf_path = write_gguf(Path(hf_refs["qwen2_bias"].path), tmp_path / "q.gguf", "Q8_0")
    arch = ModelArchConfig.from_pretrained(gguf_path)
    assert arch.qkv_bias
    _check_slices(gguf_path, arch, 2)
