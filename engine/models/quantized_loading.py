"""Which of a GGUF file's matrices stay on their quantized blocks, and the modules that hold them.

Decided before any weight is allocated: on the meta device the model's linears (and its
embedding, with a tied head) are swapped for `QuantLinear` / `QuantEmbedding` wherever every
checkpoint matrix they stack is in a type the kernels compute on (engine/layers/quantized.py),
so a float32 copy of those matrices never exists. Under tensor parallelism a rank's slice must
be whole rows or whole blocks of columns; a matrix split inside a block is dequantized as
before. Everything else (norms, biases, other types) loads as floats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from engine.layers.quantized import (
    QUANT_TYPES,
    QUANTIZED_BACKENDS,
    BlockKernels,
    QuantEmbedding,
    QuantLinear,
)
from engine.models.gguf_file import hf_tensor_name
from engine.parallel.layout import SKIP, TPLayout

if TYPE_CHECKING:  # engine.models.loader imports this module, and llama
    from engine.models.llama import LlamaForCausalLM

# The linears of a decoder layer: module path under the layer -> the checkpoint matrices it
# stacks, in order.
_LAYER_LINEARS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def quantized_plan(reader: Any, layout: TPLayout) -> dict[str, str]:
    """Hugging Face weight name -> block type, for the file's matrices this rank can keep on
    their blocks."""
    import gguf

    plan: dict[str, str] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        type_name = tensor.tensor_type.name
        if name is None or type_name not in QUANT_TYPES or len(tensor.shape) != 2:
            continue
        where = layout.tensor_slice(name)
        if where == SKIP:
            continue
        if where is not None:
            assert not isinstance(where, str)
            dim, start, stop = where
            block = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
            if dim == 1 and (start % block or stop % block):
                continue  # this rank's columns start or end inside a block
        plan[name] = type_name
    return plan


def swap_quantized_modules(
    model: LlamaForCausalLM, plan: dict[str, str], kernels: BlockKernels
) -> set[str]:
    """Replace the modules `plan` covers (on the meta device); returns the weight names they
    take in their block types (the loader hands those over undequantized)."""
    kept: set[str] = set()
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        for path, sources in _LAYER_LINEARS.items():
            names = [f"{prefix}.{source}.weight" for source in sources]
            if not all(name in plan for name in names):
                continue
            parent_path, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            old = getattr(parent, attr)
            sizes = tuple(getattr(old, "shard_sizes", [old.out_features]))
            setattr(
                parent, attr, QuantLinear(old.in_features, sizes, old.bias is not None, kernels)
            )
            kept.update(names)
    kept.update(_swap_table_and_head(model, plan, kernels))
    return kept


def _swap_table_and_head(model: Any, plan: dict[str, str], kernels: BlockKernels) -> set[str]:
    kept: set[str] = set()
    embed, head = model.model.embed_tokens, model.lm_head
    tied = model.config.tie_word_embeddings
    new_head = None
    if (tied and "model.embed_tokens.weight" in plan) or (not tied and "lm_head.weight" in plan):
        new_head = QuantLinear(head.in_features, (head.out_features,), False, kernels)
        model.lm_head = new_head
        if not tied:
            kept.add("lm_head.weight")
    if "model.embed_tokens.weight" in plan:
        model.model.embed_tokens = QuantEmbedding(
            embed.num_embeddings, embed.embedding_dim, kernels, new_head if tied else None
        )
        kept.add("model.embed_tokens.weight")
    return kept


def quantized_target(name: str, modules: dict[str, nn.Module]) -> tuple[Any, int] | None:
    """The quantized module (and part index) a checkpoint matrix goes to, if any."""
    from engine.models.llama import STACKED_PROJECTIONS

    base = name.rsplit(".", 1)[0]
    module = modules.get(base)
    if isinstance(module, (QuantLinear, QuantEmbedding)):
        return module, 0
    parent, _, projection = base.rpartition(".")
    if projection in STACKED_PROJECTIONS:
        stacked, index = STACKED_PROJECTIONS[projection]
        module = modules.get(f"{parent}.{stacked}")
        if isinstance(module, QuantLinear):
            return module, index
    return None


def incomplete_modules(model: nn.Module) -> list[str]:
    """Quantized modules still without their weight (the checkpoint lacked a matrix)."""
    return [
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, (QuantLinear, QuantEmbedding)) and not module.complete
    ]


def block_kernels(
    path: str, backend: str, device: Any, dtype: Any, insist: bool = True
) -> BlockKernels | None:
    """The kernels when this engine keeps `path`'s quantized matrices on their blocks, else
    None. `quantized` and `quantized_float` insist (ValueError where they cannot; not for a
    draft model: `insist=False`); `auto` chooses `quantized` where `auto_keeps_blocks` says."""
    import torch

    from engine.layers import cpu_kernels

    if backend == "auto":
        if not auto_keeps_blocks(path, device.type, dtype == torch.float32):
            return None
        return BlockKernels(cpu_kernels.load(), insist=False)
    if backend not in QUANTIZED_BACKENDS:
        return None
    if device.type != "cpu" or dtype != torch.float32:
        if insist:
            raise ValueError(f"linear backend {backend!r} needs a CPU device and dtype float32")
        return None
    if not insist and not gguf_has_quantized(path):
        return None
    try:
        module = cpu_kernels.load()
    except cpu_kernels.KernelBuildError as exc:
        if insist:
            raise ValueError(f"linear backend {backend!r}: {exc}") from None
        return None
    return BlockKernels(module, float_activations=backend == "quantized_float", insist=insist)


def auto_keeps_blocks(path: str, device_type: str, float32: bool) -> bool:
    """Whether linear_backend `auto` computes on `path`'s blocks: a float32 engine on a CPU,
    a GGUF file with matrices in the kernels' types, and an int8 vector kernel (AVX-512 VNNI or
    AVX2) built here — the portable loop is the oracle the vector kernels are tested against,
    slower than the float32 path."""
    from engine.layers import cpu_kernels

    if device_type != "cpu" or not float32 or not gguf_has_quantized(path):
        return False
    try:
        return cpu_kernels.load().quant_int8_kernels()[0] != "portable"
    except cpu_kernels.KernelBuildError:
        return False


def gguf_has_quantized(path: str) -> bool:
    """Whether `path` is a GGUF file with matrices in a type the kernels compute on."""
    from engine.models.catalog import is_gguf_path
    from engine.models.gguf_file import open_gguf

    if not is_gguf_path(path):
        return False
    return any(t.tensor_type.name in QUANT_TYPES for t in open_gguf(path).tensors)
