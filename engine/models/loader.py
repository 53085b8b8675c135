"""Load a Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM

# Buffers some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in model directory {str(path)!r}")
    return files


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    path: str | Path,
    config: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    """Build the model without touching memory (meta device), then fill it from disk."""
    path = Path(path)
    with _default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model.to_empty(device=device)
    model.tie_weights()
    _load_weights(model, safetensors_files(path), config)
    model.model.rotary.build(device)
    return model.eval()


def _load_weights(model: nn.Module, files: list[Path], config: ModelArchConfig) -> None:
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                param = params.get(name)
                if param is None:
                    unexpected.append(name)
                    continue
                tensor = shard.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)}, "
                        f"the config implies {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint has weights the model does not: {sorted(unexpected)[:8]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:8]}")
