"""Random-weight checkpoints in the shape of real models, for benchmarks that need a model's
size and head counts but not its answers (no model hub here: the weights are drawn).

`pdserve bench tp` needs a model whose heads two ranks can split: SmolLM2-135M has 9 query
heads, so it uses Qwen2.5-0.5B's shape (14 query heads, 2 KV heads) by default.
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
}
_STD = 0.02


def shaped_checkpoint(name: str, seed: int = 0) -> Path:
    """The directory of a random-weight checkpoint shaped like `name` (built once into the
    pdserve cache)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    target = pdserve_cache_dir() / "shaped" / f"{name}-seed{seed}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f"{target.name}.lock"):
        if not (target / "model.safetensors").is_file():
            _write(target, SHAPES[name], seed)
    return target


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
    head_dim = hidden // heads
    qwen2 = config["architectures"][0] == "Qwen2ForCausalLM"

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * _STD

    weights = {"model.embed_tokens.weight": draw(config["vocab_size"], hidden)}
    weights["model.norm.weight"] = torch.ones(hidden)
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
        weights[f"{layer}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{layer}.post_attention_layernorm.weight"] = torch.ones(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = draw(config["vocab_size"], hidden)
    return weights
