"""The model's architecture, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models.catalog import is_gguf_path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool = False  # Qwen2: q, k and v projections carry a bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelArchConfig:
        """From a model directory's config.json, or from a GGUF file's metadata."""
        if is_gguf_path(path):
            from engine.models.gguf_file import gguf_arch_config, open_gguf

            # vocabulary: the token count stands in for a missing vocab_size
            return gguf_arch_config(open_gguf(path, vocabulary=True), Path(path).name)
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in model directory {str(path)!r}")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelArchConfig:
        architecture = _architecture(raw)
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // heads
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=_rope_config(raw),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            extra=raw,
        )


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    raise ValueError(
        f"unsupported model architecture {names or raw.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: linear, llama3")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("use_sliding_window") is False:
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)
