"""Write a Hugging Face checkpoint directory as a GGUF file, as llama.cpp's converter would.

For tests: they cannot download GGUF files, so they write small ones from random-weight HF
models (and check the engine against transformers loading the same file). The `gguf` package
does the writing and the quantizing; this module only lays the tensors out the llama.cpp way
(its names, q/k rows permuted for Llama, norms and biases kept in F32).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from engine.models.config import ModelArchConfig
from engine.models.gguf_file import GGUF_ARCHITECTURES, gguf_tensor_name

_HF_TO_GGUF_ARCH = {hf: name for name, hf in GGUF_ARCHITECTURES.items()}


def write_gguf(
    model_dir: Path, out: Path, tensor_type: str = "F32", pre_tokenizer: str = "gpt-2"
) -> Path:
    """`model_dir` (config.json + model.safetensors) as a GGUF file at `out`, its matrices of
    `tensor_type` (F32, F16, BF16, Q8_0, Q4_0, ...); returns `out`. A byte-level BPE
    tokenizer.json beside them goes into the metadata, its pre-tokenizer named
    `pre_tokenizer` (llama.cpp's `tokenizer.ggml.pre`)."""
    config = ModelArchConfig.from_pretrained(model_dir)
    if config.rope.rope_type != "default":
        raise ValueError(f"rope scaling {config.rope.rope_type!r} is not written to GGUF here")
    arch = _HF_TO_GGUF_ARCH[config.architecture]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    writer = gguf.GGUFWriter(str(out), arch=arch)
    _write_config(writer, config)
    if (model_dir / "tokenizer.json").is_file():
        _write_tokenizer(writer, model_dir, pre_tokenizer)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for hf_name, array in tensors.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = array.astype(np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (
                config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            )
            array = _permute(array, heads)
        name = gguf_tensor_name(hf_name)
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        _add_tensor(writer, name, array, qtype)
    save(writer)
    return out


def save(writer: gguf.GGUFWriter) -> None:
    """Write what `writer` holds to its file, in the order GGUF lays it out, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_config(writer: gguf.GGUFWriter, config: ModelArchConfig) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope.theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, pre_tokenizer: str) -> None:
    """tokenizer.json (a byte-level BPE) and tokenizer_config.json as `tokenizer.ggml.*`."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    settings = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if spec["model"]["type"] != "BPE":
        raise ValueError("only byte-level BPE tokenizers are written to GGUF here")
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    kinds = {token_id: gguf.TokenType.NORMAL for token_id in vocab.values()}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        special = added["special"]
        kinds[added["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types([kinds[vocab[token]] for token in tokens])
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        if isinstance(settings.get(key), str):
            add(vocab[settings[key]])
    writer.add_add_bos_token(bool(settings.get("add_bos_token", False)))
    if isinstance(settings.get("chat_template"), str):
        writer.add_chat_template(settings["chat_template"])


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> None:
    if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)  # norms and biases stay F32, as llama.cpp keeps them
        return
    if qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
        return
    if qtype.name in _K_HALVES:  # the gguf package cannot quantize these
        rows, cols = array.shape
        quantized = random_k_blocks(qtype, rows, cols, seed=zlib.crc32(name.encode()))
    else:
        quantized = gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=qtype)


# Where each K type's float16 fields (d, dmin) sit in its block.
_K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_k_blocks(
    qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int
) -> np.ndarray:
    """Random blocks of a K type for a [rows, cols] matrix (uint8 [rows, row bytes]): every
    byte pattern is a valid block once its float16 scales are sane ones. The `gguf` package
    cannot quantize K types, so files written with them hold these: for tests of loading and
    of kernels (the weights are noise of the right shape), not of what a model says."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    for offset in _K_HALVES[qtype.name]:
        scale = rng.uniform(0.0005, 0.002, size=(rows, cols // block)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within a head, HF's halves -> interleaved pairs."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )
