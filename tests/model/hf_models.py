"""Small random-weight Hugging Face checkpoints for parity tests (transformers: tests only)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Larger than the 0.02 default: decisive logits, so float rounding cannot flip an argmax.
    initializer_range=0.08,
    eos_token_id=None,
    bos_token_id=None,
)

ARCHITECTURES = {
    "llama_gqa": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama3_rope_tied": lambda: transformers.LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2_bias": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(
        **COMMON, head_dim=16, tie_word_embeddings=True
    ),
    "mistral": lambda: transformers.MistralConfig(
        **COMMON, sliding_window=8, tie_word_embeddings=False
    ),
}


def make_hf_model(name: str, path: Path, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = ARCHITECTURES[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
