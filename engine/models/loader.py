"""Load a checkpoint: a Hugging Face directory (config.json + safetensors, sharded or not) or a
GGUF file (`gguf_file.py` maps its tensors to the Hugging Face names first).

A tensor-parallel rank reads only its slice of each tensor (`TPLayout.tensor_slice`):
safetensors reads the slice's bytes, GGUF dequantizes only its rows (and only its columns
where they start and end on a quantization block).

With `block_kernels`, a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices are not
dequantized: the modules that use them are swapped for ones computing on the blocks before
anything is allocated (engine/models/quantized_loading.py).

With load_format "dummy" (vLLM's), no weight file is read: the model is built from its
config.json alone and every parameter drawn from a fixed seed (`initialize_dummy_weights`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeGuard

import torch
from safetensors import safe_open
from torch import nn

from engine.config import check_load_format
from engine.layers.quantized import QUANT_TYPES, BlockKernels, QuantizedTensor, QuantLinear
from engine.models.catalog import is_gguf_path
from engine.models.config import ModelArchConfig
from engine.models.llama import STACKED_PROJECTIONS, LlamaForCausalLM, StackedLinear
from engine.models.quantized_loading import (
    incomplete_modules,
    quantized_plan,
    quantized_target,
    swap_quantized_modules,
)
from engine.parallel.group import SINGLE_RANK, TPGroup
from engine.parallel.layout import SKIP, TensorSlice, TPLayout

# Buffers some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# load_format "dummy": fixed, as vLLM's, so that engines of any seed share one set of weights.
DUMMY_WEIGHTS_SEED = 0
_DUMMY_STD = 0.02


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
    layout: TPLayout | None = None,
    group: TPGroup = SINGLE_RANK,
    block_kernels: BlockKernels | None = None,
    load_format: str = "auto",
) -> LlamaForCausalLM:
    """Build the model without touching memory (meta device), then fill it from disk (this
    rank's slice of it, under tensor parallelism). With `block_kernels`, keep what the GGUF
    file quantized on its blocks; a ValueError if nothing can be. With `load_format` "dummy",
    fill it with random weights instead, reading nothing (a GGUF file: a ValueError)."""
    path = Path(path)
    check_load_format(load_format, is_gguf_path(path))
    layout = layout or TPLayout(config)
    keep: frozenset[str] = frozenset()
    with _default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, layout, group)
        if block_kernels is not None:
            keep = _keep_quantized(model, path, layout, block_kernels)
    # Module.to_empty's empty_like runs torch's Python reference on meta tensors, which
    # imports sympy (seconds in every process that loads a model); empty by shape does not.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    if load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        _load_weights(model, checkpoint_tensors(path, config, layout, keep), config)
    model.model.rotary.build(device)
    return model.eval()


def initialize_dummy_weights(model: LlamaForCausalLM, seed: int = DUMMY_WEIGHTS_SEED) -> None:
    """Fill this rank's parameters where they lie: RMSNorm weights 1, biases 0, the rest
    normal(0, 0.02) from a generator on the parameters' device (no host round trip for 16 GB
    of weights). Every rank draws its own slice from the same seed; the vocabulary's padding
    rows are zero, as the checkpoint loader leaves them."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    device = next(iter(params.values())).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in params.items():
            if param.dim() == 1 and name.endswith("norm.weight"):  # also q_norm, layernorm
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, _DUMMY_STD, generator=generator)
        _zero_vocab_padding(model)


def _zero_vocab_padding(model: LlamaForCausalLM) -> None:
    """Zero the rows past the vocabulary's end (the last rank's padding) of the embedding and
    the head."""
    layout = model.layout
    real_rows = max(0, model.config.vocab_size - layout.vocab_start)
    if real_rows >= layout.vocab_rows:
        return
    model.model.embed_tokens.weight[real_rows:].zero_()
    model.lm_head.weight[real_rows:].zero_()  # the same tensor where tied: zeroed twice


def _keep_quantized(
    model: LlamaForCausalLM, path: Path, layout: TPLayout, kernels: BlockKernels
) -> frozenset[str]:
    from engine.models.gguf_file import open_gguf

    plan = quantized_plan(open_gguf(path), layout) if is_gguf_path(path) else {}
    kept = swap_quantized_modules(model, plan, kernels) if plan else set()
    if not kept and kernels.insist:
        raise ValueError(
            f"the quantized linear backends need a GGUF checkpoint with matrices in "
            f"{', '.join(QUANT_TYPES)}; {path.name} has none this engine can keep"
        )
    return frozenset(kept)


def checkpoint_tensors(
    path: Path,
    config: ModelArchConfig,
    layout: TPLayout | None = None,
    keep: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(Hugging Face name, tensor) for every weight of the checkpoint, one at a time: this
    rank's slice of it, where `layout` splits the model; GGUF matrices named in `keep` in
    their block types."""
    layout = layout or TPLayout(config)
    if is_gguf_path(path):
        from engine.models.gguf_file import forget_readers, gguf_tensors, open_gguf

        yield from gguf_tensors(open_gguf(path), config, path.name, layout, keep)
        forget_readers()  # the weights are the last an engine reads of the file
        return
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                where = layout.tensor_slice(name)
                if where == SKIP:
                    continue
                if where is None:
                    yield name, shard.get_tensor(name)
                else:
                    assert not isinstance(where, str)
                    yield name, _read_slice(shard.get_slice(name), where)


def _read_slice(tensor: object, where: TensorSlice) -> torch.Tensor:
    """Rows or columns [start, stop) of a safetensors slice handle, read alone; past the
    tensor's end (the vocabulary's padding) zeros."""
    dim, start, stop = where
    length = tensor.get_shape()[dim]  # type: ignore[attr-defined]
    end = min(stop, length)
    part = tensor[start:end] if dim == 0 else tensor[:, start:end]  # type: ignore[index]
    return pad_slice(part, dim, stop - start)


def pad_slice(part: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`part` with zeros after it along `dim` up to `size` (a rank's share of a vocabulary that
    its size does not divide)."""
    missing = size - part.shape[dim]
    if missing <= 0:
        return part
    shape = list(part.shape)
    shape[dim] = missing
    return torch.cat([part, part.new_zeros(shape)], dim=dim)


def _load_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
    config: ModelArchConfig,
) -> None:
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if isinstance(tensor, QuantizedTensor):
            quantized = quantized_target(name, modules)
            if quantized is None:
                unexpected.append(name)
            else:
                quantized[0].load_part(quantized[1], tensor)
            continue
        target = _target(name, params, modules)
        if target is None:
            unexpected.append(name)
            continue
        param_name, rows = target
        _copy(name, tensor, params[param_name], rows)
        loaded.add(name if rows is None else f"{param_name}[{rows.start}]")
    if unexpected:
        raise ValueError(f"checkpoint has weights the model does not: {sorted(unexpected)[:8]}")
    missing = sorted(_expected_names(params, modules) - loaded) + incomplete_modules(model)
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:8]}")


def _target(
    name: str, params: dict[str, nn.Parameter], modules: dict[str, nn.Module]
) -> tuple[str, slice | None] | None:
    """The parameter (and rows of it, for a stacked projection) a checkpoint tensor fills."""
    if name in params:
        return name, None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED_PROJECTIONS:
        stacked, index = STACKED_PROJECTIONS[parts[-2]]
        module_name = ".".join([*parts[:-2], stacked])
        module = modules.get(module_name)
        param_name = f"{module_name}.{parts[-1]}"
        if _stacked(module) and param_name in params:
            return param_name, module.shard_rows(index)
    return None


def _copy(name: str, tensor: torch.Tensor, param: nn.Parameter, rows: slice | None) -> None:
    destination = param if rows is None else param[rows]
    if tuple(tensor.shape) != tuple(destination.shape):
        raise ValueError(
            f"weight {name} has shape {tuple(tensor.shape)}, "
            f"the config implies {tuple(destination.shape)}"
        )
    with torch.no_grad():
        destination.copy_(tensor)


def _expected_names(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> set[str]:
    """What a complete checkpoint fills: plain parameters, and every shard of stacked ones."""
    expected: set[str] = set()
    for name in params:
        module = modules.get(name.rsplit(".", 1)[0])
        if _stacked(module):
            expected.update(
                f"{name}[{module.shard_rows(i).start}]" for i in range(len(module.shard_sizes))
            )
        else:
            expected.add(name)
    return expected


def _stacked(module: nn.Module | None) -> TypeGuard[StackedLinear | QuantLinear]:
    """A layer holding several checkpoint matrices (and biases) one after another."""
    if isinstance(module, StackedLinear):
        return True
    return isinstance(module, QuantLinear) and len(module.shard_sizes) > 1
