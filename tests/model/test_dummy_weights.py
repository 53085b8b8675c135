"""load_format "dummy" (vLLM's): a model built from its config.json alone, every weight drawn
from a fixed seed, no weight file read."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.config import ModelConfig
from engine.llm import LLM
from engine.models import loader
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.parallel.layout import TPLayout
from engine.request import SamplingParams
from engine.testing import shaped_checkpoint as shaped
from engine.testing.shaped_checkpoint import shaped_checkpoint, shaped_config_dir
from pdserve.cli_options import ENGINE_FLAGS
from pdserve.flags import add_flags, read_flags

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "vocab_size": 257,  # odd: the last of 2 ranks holds a padding row
    "torch_dtype": "float32",
}
PROMPT = [11, 22, 33, 44, 55]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def config_dir(tmp_path: Path, **overrides: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return tmp_path


def dummy_llm(path: Path, engine_device: dict[str, str], **kw: object) -> LLM:
    args = dict(max_model_len=64, num_gpu_blocks_override=64, load_format="dummy")
    return LLM(str(path), **{**args, **engine_device, **kw})


def build(path: Path, layout: TPLayout | None = None) -> LlamaForCausalLM:
    arch = ModelArchConfig.from_pretrained(path)
    cpu = torch.device("cpu")
    return load_model(path, arch, torch.float32, cpu, 64, layout, load_format="dummy")


def build_with(path: Path, load_format: str) -> None:
    arch = ModelArchConfig.from_pretrained(path)
    load_model(path, arch, torch.float32, torch.device("cpu"), 64, load_format=load_format)


def test_an_engine_generates_from_a_directory_with_only_config_json(
    tmp_path, engine_device, monkeypatch
):
    def no_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("dummy weights opened a checkpoint file")

    monkeypatch.setattr(loader, "safe_open", no_reads)
    path = config_dir(tmp_path)
    llm = dummy_llm(path, engine_device)
    tokens = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    assert len(tokens) == 8 and all(0 <= t < TINY_LLAMA["vocab_size"] for t in tokens)
    assert [p.name for p in path.iterdir()] == ["config.json"]


def test_same_seed_same_weights_and_greedy_output(tmp_path, engine_device):
    path = config_dir(tmp_path)
    one, two = build(path).state_dict(), build(path).state_dict()
    assert one.keys() == two.keys()
    assert all(torch.equal(one[name], two[name]) for name in one)
    outputs = [
        dummy_llm(path, engine_device, seed=0).generate([{"prompt_token_ids": PROMPT}], GREEDY)
        for _ in range(2)
    ]
    assert outputs[0][0].outputs[0].token_ids == outputs[1][0].outputs[0].token_ids


def test_norms_are_one_biases_zero_and_the_rest_drawn(tmp_path):
    path = config_dir(tmp_path, architectures=["Qwen2ForCausalLM"])  # q/k/v biases
    params = dict(build(path).named_parameters())
    norms = [n for n in params if n.endswith("norm.weight")]
    biases = [n for n in params if n.endswith(".bias")]
    assert norms and biases
    assert all(torch.all(params[n] == 1.0) for n in norms)
    assert all(torch.all(params[n] == 0.0) for n in biases)
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert abs(qkv.std().item() - 0.02) < 0.002


def test_a_tied_head_stays_the_embedding(tmp_path):
    model = build(config_dir(tmp_path))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = build(config_dir(tmp_path, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_each_rank_fills_its_own_slice(tmp_path):
    path = config_dir(tmp_path)
    arch = ModelArchConfig.from_pretrained(path)
    whole = build(path)
    for rank in range(2):
        layout = TPLayout(arch, rank, 2)
        part = build(path, layout)
        assert part.model.embed_tokens.weight.shape == (layout.vocab_rows, 64)
        qkv = part.model.layers[0].self_attn.qkv_proj.weight
        assert qkv.shape[0] == whole.model.layers[0].self_attn.qkv_proj.weight.shape[0] // 2
    # 257 rows over 2 ranks of 129: rank 1's last row is padding, zero as the loader pads.
    padded = build(path, TPLayout(arch, 1, 2)).model.embed_tokens.weight
    assert torch.all(padded[-1] == 0) and torch.any(padded[-2] != 0)


@pytest.mark.parametrize(
    "make",
    [
        lambda path: EngineArgs.from_kwargs(str(path), load_format="fast").create_engine_config(),
        lambda path: ModelConfig(model=str(path), load_format="fast"),
        lambda path: build_with(path, "fast"),
    ],
)
def test_an_unknown_load_format_is_refused(tmp_path, make):
    with pytest.raises(ValueError, match=r"load_format must be one of \('auto', 'dummy'\)"):
        make(config_dir(tmp_path))


def test_the_flag_reaches_the_engine_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineArgs, flags=ENGINE_FLAGS)
    args = parser.parse_args(["--model", str(config_dir(tmp_path)), "--load-format", "dummy"])
    config, _ = EngineArgs(
        **read_flags(args, EngineArgs, flags=ENGINE_FLAGS)
    ).create_engine_config()
    assert config.model.load_format == "dummy"


def test_a_gguf_file_with_dummy_is_refused(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")  # refused before it is read
    arch = ModelArchConfig.from_dict(TINY_LLAMA)
    with pytest.raises(ValueError, match="load_format 'dummy' builds the model from"):
        EngineArgs.from_kwargs(str(gguf), load_format="dummy").create_engine_config()
    with pytest.raises(ValueError, match=r"a \.gguf file has none"):
        load_model(gguf, arch, torch.float32, torch.device("cpu"), 64, load_format="dummy")


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3-8b"])
def test_shaped_config_dirs_hold_only_the_config_the_engine_reads(tmp_path, name):
    path = shaped_config_dir(name, tmp_path / name)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    arch = ModelArchConfig.from_pretrained(path)
    expected = shaped.SHAPES[name]
    assert arch.architecture == "LlamaForCausalLM" and not arch.qkv_bias
    assert arch.head_dim == expected["hidden_size"] // expected["num_attention_heads"]
    assert arch.rope.theta == expected["rope_theta"]
    assert arch.tie_word_embeddings == expected["tie_word_embeddings"]
    assert (arch.num_attention_heads, arch.num_key_value_heads) == (
        expected["num_attention_heads"],
        expected["num_key_value_heads"],
    )
    assert shaped_config_dir(name, path) == path  # again: the same file, left as it is


def test_a_shaped_checkpoint_loads_like_its_dummy_twin(tmp_path, monkeypatch):
    # A small Llama shape with an explicit head_dim and bfloat16 weights, through both writers.
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(
        shaped.SHAPES,
        "tiny-llama",
        {**TINY_LLAMA, "head_dim": 16, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    )
    checkpoint, config_only = shaped_checkpoint("tiny-llama"), shaped_config_dir("tiny-llama")
    arch = ModelArchConfig.from_pretrained(checkpoint)
    cpu = torch.device("cpu")
    real = load_model(checkpoint, arch, torch.float32, cpu, 64)
    dummy = load_model(config_only, arch, torch.float32, cpu, 64, load_format="dummy")
    shapes = {n: p.shape for n, p in real.named_parameters()}
    assert shapes == {n: p.shape for n, p in dummy.named_parameters()}
