"""Random-weight checkpoints in the shape of real models, for benchmarks that need a model's
size and head counts but not its answers (no model hub here: the weights are drawn).

`pdserve bench tp` needs a model whose heads two ranks can split: SmolLM2-135M has 9 query
heads, so it uses Qwen2.5-0.5B's shape (14 query heads, 2 KV heads) by default.

`shaped_config_dir` writes the config.json alone, for load_format "dummy" (the engine draws the
weights itself): a Llama-3-8B-shaped engine on a GPU without 16 GB of safetensors written first.
Neither writes a tokenizer: engines on these directories take token-id prompts.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.cache_dir import exclusive_lock, pdserve_cache_dir

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-0.5B-Instruct's config.json, in the fields the engine reads.
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",  # what transformers' Auto classes read
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "torch_dtype": "float32",
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct's.
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    # meta-llama/Meta-Llama-3-8B's.
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
}
_STD = 0.02


def shaped_config_dir(name: str, directory: Path | None = None) -> Path:
    """A directory holding only `name`'s config.json (`directory`, or one in the pdserve
    cache), for load_format "dummy"."""
    config = _shape(name)
    target = directory or pdserve_cache_dir() / "shaped" / f"{name}-config"
    target.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2)
    path = target / "config.json"
    if not path.is_file() or path.read_text() != text:
        # Written beside, then renamed: an engine starting at once never reads half a file.
        tmp = target / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, path)
    return target


def shaped_checkpoint(name: str, seed: int = 0) -> Path:
    """The directory of a random-weight checkpoint shaped like `name` (built once into the
    pdserve cache; Llama-3-8B's is 16 GB: prefer `shaped_config_dir` with load_format
    "dummy" where the answers do not matter)."""
    _shape(name)
    target = pdserve_cache_dir() / "shaped" / f"{name}-seed{seed}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f"{target.name}.lock"):
        if not (target / "model.safetensors").is_file():
            _write(target, SHAPES[name], seed)
    return target


def _shape(name: str) -> dict[str, Any]:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    return SHAPES[name]


def _write(target: Path, config: dict[str, Any], seed: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(_weights(config, seed), str(tmp / "model.safetensors"))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    qwen2 = config["architectures"][0] == "Qwen2ForCausalLM"
    # In the config's dtype: Llama-3-8B's 8B weights are 16 GB in bfloat16, 32 in float32.
    dtype = getattr(torch, config["torch_dtype"])

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * _STD).to(dtype)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=dtype)

    weights = {"model.embed_tokens.weight": draw(config["vocab_size"], hidden)}
    weights["model.norm.weight"] = ones(hidden)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        projections = {
            "self_attn.q_proj": heads * head_dim,
            "self_attn.k_proj": kv_heads * head_dim,
            "self_attn.v_proj": kv_heads * head_dim,
        }
        for part, rows in projections.items():
            weights[f"{layer}.{part}.weight"] = draw(rows, hidden)
            if qwen2:
                weights[f"{layer}.{part}.bias"] = draw(rows)
        weights[f"{layer}.self_attn.o_proj.weight"] = draw(hidden, heads * head_dim)
        weights[f"{layer}.mlp.gate_proj.weight"] = draw(inner, hidden)
        weights[f"{layer}.mlp.up_proj.weight"] = draw(inner, hidden)
        weights[f"{layer}.mlp.down_proj.weight"] = draw(hidden, inner)
        weights[f"{layer}.input_layernorm.weight"] = ones(hidden)
        weights[f"{layer}.post_attention_layernorm.weight"] = ones(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = draw(config["vocab_size"], hidden)
    return weights
