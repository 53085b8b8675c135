"""GGUF checkpoints (llama.cpp's format): the model config and weights, as the engine wants them.

A GGUF file holds metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and tensors under
llama.cpp's names (`blk.0.attn_q.weight`), often quantized. The `gguf` package reads both and
dequantizes; this module maps them onto what the engine already loads from Hugging Face
checkpoints: a `ModelArchConfig`, and (HF name, float tensor) pairs. Two things differ from HF:

- names: `blk.N.attn_q` is `model.layers.N.self_attn.q_proj`, and so on (`_TENSOR_NAMES`);
- llama.cpp's Llama converter permutes the rows of q and k (its RoPE rotates adjacent pairs of a
  head, HF's rotates the two halves), so for `llama` files we put the rows back (`_unpermute`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.models.config import ModelArchConfig
from engine.parallel.layout import SKIP, TensorSlice, TPLayout

if TYPE_CHECKING:  # the metadata (config, tokenizer) is read without torch: the router does
    import torch

    from engine.layers.quantized import QuantizedTensor

# GGUF `general.architecture` -> the Hugging Face architecture the engine builds.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 2/3 and Mistral files both say "llama"
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# llama.cpp's per-layer tensor names -> the Hugging Face names under model.layers.N.
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def open_gguf(path: str | Path, vocabulary: bool = False) -> Any:
    """A `gguf.GGUFReader` over `path`; a file that is not a readable GGUF is a ValueError.

    Readers are cached per file version: parsing the metadata (a 49k-token vocabulary is ~100k
    fields) takes seconds, and the config, the weights and the tokenizer each need it. Once the
    tokenizer is built its vocabulary is dropped from the cached reader
    (`release_vocabulary`); `vocabulary=True` asks for a reader that still has it (parsed
    again where needed).
    """
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as err:
        raise ValueError(f"cannot read {path.name}: {err.strerror}") from None
    reader = _open_gguf(path, stat.st_mtime_ns, stat.st_size)
    if vocabulary and getattr(reader, "pdserve_without_vocabulary", False):
        _open_gguf.cache_clear()
        reader = _open_gguf(path, stat.st_mtime_ns, stat.st_size)
    return reader


# The metadata arrays of a vocabulary: a part object per element, ~60 MB for 49k tokens.
_VOCABULARY_FIELDS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


def release_vocabulary(path: str | Path) -> None:
    """Drop the parsed vocabulary from `path`'s cached reader once the tokenizer is built:
    freed now, its memory is given back before the weights are loaded (freed at the end, what
    the loading allocated in between would keep much of it from the system)."""
    reader = open_gguf(path)
    for name in _VOCABULARY_FIELDS:
        reader.fields.pop(name, None)
    reader.pdserve_without_vocabulary = True


def forget_readers() -> None:
    """Drop the cached readers (kept only while an engine starts: config, tokenizer, weights);
    the next open parses again."""
    _open_gguf.cache_clear()


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> Any:
    try:
        return _reader_class()(path)
    except Exception as err:  # the reader raises ValueError, KeyError, IndexError on bad bytes
        raise ValueError(
            f"{path.name} is not a readable GGUF file (truncated or another format): "
            f"{_one_line(err)}"
        ) from None


@functools.cache
def _reader_class() -> type:
    """gguf's reader over a plain array view of its memory map. It parses with a slice per
    value (~250k for a 49k-token vocabulary); slicing an np.memmap makes memmap objects, whose
    bookkeeping was 60% of the parse (4.0 s -> 1.6 s for SmolLM2). The bytes stay mapped."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> Any:
            return self._array

        @data.setter
        def data(self, mapped: Any) -> None:  # GGUFReader.__init__ sets its np.memmap
            self._array = mapped.view(np.ndarray)

    return Reader


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_arch_config(reader: Any, name: str) -> ModelArchConfig:
    """The model config from a GGUF's metadata, as a HF config.json would give it."""
    gguf_arch = metadata(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{name}: unsupported GGUF architecture {gguf_arch!r}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}
    _check_tensor_types(reader, name)
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{name}: per-frequency RoPE factors (rope_freqs) are not supported")

    def key(suffix: str, default: Any = None) -> Any:
        return metadata(reader, f"{gguf_arch}.{suffix}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab_size = key("vocab_size") or len(metadata(reader, "tokenizer.ggml.tokens", []))
    eos = metadata(reader, "tokenizer.ggml.eos_token_id")
    raw: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[gguf_arch]],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 2048)),
        # No output matrix in the file: the head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(key),
        "sliding_window": key("attention.sliding_window"),
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
    }
    return ModelArchConfig.from_dict(raw)


def _rope_scaling(key: Any) -> dict[str, Any] | None:
    scaling = key("rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling != "linear":
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
    return {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}


def gguf_tensors(
    reader: Any,
    config: ModelArchConfig,
    name: str,
    layout: TPLayout | None = None,
    keep: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, dequantized: this
    rank's slice of it where `layout` splits the model. The matrices named in `keep` come in
    their block types instead (`QuantizedTensor`), sliced and un-permuted the same way."""
    import torch

    from engine.models.loader import pad_slice

    layout = layout or TPLayout(config)
    unpermute = config.architecture == "LlamaForCausalLM"
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None:
            raise ValueError(f"{name}: unexpected tensor {tensor.name!r} for {config.architecture}")
        where = layout.tensor_slice(hf_name)
        if where == SKIP:
            continue
        if hf_name in keep:
            assert not isinstance(where, str)
            yield hf_name, _quantized_rows(tensor, where, layout, unpermute, hf_name)
            continue
        if where is None:
            weights = torch.from_numpy(_dequantize(tensor, name))
        else:
            assert not isinstance(where, str)
            part = _dequantize_slice(tensor, name, where)
            weights = pad_slice(part, where[0], where[2] - where[1])
        # A rank's rows hold whole heads: un-permute within each of this rank's heads.
        if unpermute and hf_name.endswith("q_proj.weight"):
            weights = _unpermute(weights, layout.num_heads)
        elif unpermute and hf_name.endswith("k_proj.weight"):
            weights = _unpermute(weights, layout.num_kv_heads)
        yield hf_name, weights


def _quantized_rows(
    tensor: Any, where: TensorSlice | None, layout: TPLayout, unpermute: bool, hf_name: str
) -> QuantizedTensor:
    """A matrix's stored rows, undequantized: this rank's rows (zero rows past the end of a
    padded vocabulary: scale 0), or its whole blocks of columns."""
    import gguf
    import torch

    from engine.layers.quantized import QuantizedTensor
    from engine.models.loader import pad_slice

    rows, cols = (int(n) for n in reversed(tensor.shape.tolist()))
    data = tensor.data  # uint8 [rows, row bytes]
    if where is not None:
        dim, start, stop = where
        if dim == 0:
            part = torch.from_numpy(np.array(data[start : min(stop, rows)]))
            raw = pad_slice(part, 0, stop - start)
        else:
            block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
            raw = torch.from_numpy(
                np.array(data[:, start // block * block_bytes : stop // block * block_bytes])
            )
            cols = stop - start
    else:
        raw = torch.from_numpy(np.array(data))
    if unpermute and hf_name.endswith("q_proj.weight"):  # whole rows move: exact on blocks
        raw = _unpermute(raw, layout.num_heads)
    elif unpermute and hf_name.endswith("k_proj.weight"):
        raw = _unpermute(raw, layout.num_kv_heads)
    return QuantizedTensor(raw.contiguous(), tensor.tensor_type.name, cols, hf_name)


def _dequantize_slice(tensor: Any, name: str, where: TensorSlice) -> torch.Tensor:
    """Elements [start, stop) of a bias; rows [start, stop) of a matrix dequantized alone
    (llama.cpp quantizes each row by itself), its columns the same where they start and end
    on a quantization block, else dequantized whole and cut."""
    import gguf
    import torch

    dim, start, stop = where
    data = tensor.data
    shape_in = [int(n) for n in reversed(tensor.shape.tolist())]
    if len(shape_in) == 1:  # a bias: stored as floats, one per row of its matrix
        stop = min(stop, shape_in[0])
        values = _dequantize_array(np.ascontiguousarray(data[start:stop]), tensor, name, (-1,))
        return torch.from_numpy(values)
    rows, cols = shape_in
    if dim == 0:
        stop = min(stop, rows)
        part, shape = data[start:stop], (stop - start, cols)
    else:
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        if data.dtype != np.uint8:  # float types come back as elements, not bytes
            part, shape = data[:, start:stop], (rows, stop - start)
        elif start % block == 0 and stop % block == 0:
            part = data[:, start // block * block_bytes : stop // block * block_bytes]
            shape = (rows, stop - start)
        else:
            whole = torch.from_numpy(_dequantize(tensor, name))
            return whole[:, start:stop].contiguous()
    values = _dequantize_array(np.ascontiguousarray(part), tensor, name, shape)
    return torch.from_numpy(values)


def hf_tensor_name(gguf_name: str) -> str | None:
    match = _LAYER_TENSOR.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        mapped = _LAYER_TENSOR_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    mapped = _GLOBAL_TENSOR_NAMES.get(base)
    return None if mapped is None or kind != "weight" else f"{mapped}.{kind}"


def gguf_tensor_name(hf_name: str) -> str | None:
    """The inverse of `hf_tensor_name` (for writers of GGUF files)."""
    prefix, _, rest = hf_name.partition("model.layers.")
    if not prefix and rest:
        layer, _, part = rest.partition(".")
        base, _, kind = part.rpartition(".")
        gguf_part = _INVERSE_LAYER_NAMES.get(base)
        return None if gguf_part is None else f"blk.{layer}.{gguf_part}.{kind}"
    base, _, kind = hf_name.rpartition(".")
    gguf_base = _INVERSE_GLOBAL_NAMES.get(base)
    return None if gguf_base is None else f"{gguf_base}.{kind}"


_INVERSE_LAYER_NAMES = {hf: name for name, hf in _LAYER_TENSOR_NAMES.items()}
_INVERSE_GLOBAL_NAMES = {hf: name for name, hf in _GLOBAL_TENSOR_NAMES.items()}


def _check_tensor_types(reader: Any, name: str) -> None:
    """Refuse a file with a tensor type we cannot load before anything is allocated for it."""
    supported = supported_tensor_types()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported:
            raise ValueError(_unsupported_type(name, tensor))


def _unsupported_type(name: str, tensor: Any) -> str:
    return (
        f"{name}: tensor {tensor.name} is {tensor.tensor_type.name}, which the gguf package "
        f"cannot dequantize; supported: {', '.join(supported_tensor_types())}"
    )


def _dequantize(tensor: Any, name: str) -> np.ndarray:
    # The reader's shape lists llama.cpp's dimensions fastest first; torch wants them reversed.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return _dequantize_array(tensor.data, tensor, name, shape)


def _dequantize_array(data: Any, tensor: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """`data` (`tensor`'s stored data, or whole rows or blocks of it) as float32 `shape`."""
    from gguf import quants

    try:  # types are checked with the config (_check_tensor_types); this is the backstop
        values = quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(_unsupported_type(name, tensor)) from None
    values = values.reshape(shape).astype(np.float32, copy=False)
    # F32 tensors come back as views of the read-only file mapping; torch wants writable memory.
    return values if values.flags.writeable else values.copy()


@functools.cache
def supported_tensor_types() -> tuple[str, ...]:
    """The GGUF tensor types this installation can load: those the gguf package dequantizes."""
    import gguf
    from gguf import quants

    supported = []
    for qtype in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES.get(qtype, (0, 0))
        if not type_size or qtype.name in _INTEGER_TYPES:
            continue
        try:
            quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        supported.append(qtype.name)
    return tuple(supported)


# Integer tensors hold indices, not weights: a checkpoint's matrices are never of these types.
_INTEGER_TYPES = frozenset({"I8", "I16", "I32", "I64"})


def _unpermute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within a head, its rows (pairs first) -> HF's (halves)."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
        .transpose(1, 2)
        .reshape(weights.shape)
    )


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
