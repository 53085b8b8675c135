"""Linear layers and embedding tables that compute on a GGUF file's quantized blocks.

A GGUF matrix in Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K is kept in its block type
(csrc/quant_formats.h rearranges the blocks into SIMD tiles; csrc/quant_gemm.h says how the
products are computed): a `QuantLinear` multiplies by it, a `QuantEmbedding` looks rows up in
it (a tied head and its embedding share one table). The loader
(engine/models/quantized_loading.py) puts these modules in the model before any float weight
is allocated, and hands them the raw rows of the file.

`linear_backend`: "quantized" insists (a ValueError where nothing can be kept quantized);
"auto" chooses it on CPUs with an int8 vector kernel for float32 engines on GGUF files with
such tensors. Both quantize the activations to int8 per block of 32, like llama.cpp's Q8_0
(fastest; costs some accuracy).
"quantized_float" keeps the blocks but multiplies float32 activations by the weights
dequantized in registers: the float path's bits at the file's memory, more slowly. Every other
backend dequantizes to float32 at load, the oracle these layers are measured against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.layers.linear import check_token_ids, rows_through, stacked_rows

# GGML type name -> its id (what csrc/quant_formats.h's `Type` takes).
QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

QUANTIZED_BACKENDS = ("quantized", "quantized_float")


@dataclass(frozen=True)
class BlockKernels:
    """The CPU kernel module, how activations meet the blocks (`quantized_float`: float32,
    else int8), and whether a checkpoint with nothing to keep on them is an error (an explicit
    backend) or loads as floats (`auto`, a draft model)."""

    module: Any
    float_activations: bool = False
    insist: bool = True

    def weight(self, in_features: int, parts: dict[int, QuantizedTensor]) -> Any:
        """A QuantWeight of `parts` stacked in index order."""
        weight = self.module.QuantWeight(in_features, self.float_activations)
        for index in sorted(parts):
            part = parts[index]
            weight.add(part.raw.contiguous(), QUANT_TYPES[part.type_name])
        return weight


@dataclass(frozen=True)
class QuantizedTensor:
    """A checkpoint matrix in its block type: `raw` holds its rows as the file stores them
    (uint8 [rows, in_features / block weights * block bytes]); a rank's slice is whole rows,
    or whole blocks of columns."""

    raw: torch.Tensor
    type_name: str
    in_features: int
    name: str  # the Hugging Face name, for errors

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.in_features


class QuantLinear(nn.Module):
    """y = x W^T + b with W on its blocks; several checkpoint matrices stacked in one layer
    (q, k, v) are parts of one weight, each in its own type. `bias` is a float parameter the
    loader fills like any other."""

    def __init__(
        self, in_features: int, shard_sizes: tuple[int, ...], bias: bool, kernels: BlockKernels
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(shard_sizes)
        self.shard_sizes = list(shard_sizes)
        self._kernels = kernels
        self._parts: dict[int, QuantizedTensor] = {}
        self.weight_q: Any = None  # a QuantWeight once every part is loaded
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def shard_rows(self, index: int) -> slice:
        return stacked_rows(self.shard_sizes, index)

    def load_part(self, index: int, tensor: QuantizedTensor) -> None:
        """Part `index` of the stacked weight (0 for a plain layer); the weight is built once
        every part has come, in order, whatever order the file lists them in."""
        rows = self.shard_sizes[index]
        if tensor.shape != (rows, self.in_features):
            raise ValueError(
                f"weight {tensor.name} has shape {tensor.shape}, "
                f"the config implies {(rows, self.in_features)}"
            )
        self._parts[index] = tensor
        if len(self._parts) == len(self.shard_sizes):
            self.share(self._kernels.weight(self.in_features, self._parts))
            self._parts = {}

    def share(self, weight: Any) -> None:
        self.weight_q = weight

    @property
    def complete(self) -> bool:
        return self.weight_q is not None

    @property
    def int8_activations(self) -> bool:
        return not self._kernels.float_activations

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        def call(rows: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
            return self.weight_q.forward(rows, self.bias, res)

        return rows_through(call, x, residual, self.out_features, "pdserve::quant_linear")

    def extra_repr(self) -> str:
        types = "" if self.weight_q is None else ",".join(_type_names(self.weight_q.types))
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}"


class QuantEmbedding(nn.Module):
    """An embedding table on its blocks: each looked-up row is dequantized exactly as the float
    path dequantizes it at load. A tied output head (`head`) shares the table."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        kernels: BlockKernels,
        head: QuantLinear | None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self._kernels = kernels
        self.head = [head]  # in a list: not a submodule (the model holds it as lm_head)
        self.weight_q: Any = None

    def load_part(self, index: int, tensor: QuantizedTensor) -> None:
        assert index == 0, "an embedding table is one matrix"
        if tensor.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"weight {tensor.name} has shape {tensor.shape}, "
                f"the config implies {(self.num_embeddings, self.embedding_dim)}"
            )
        self.weight_q = self._kernels.weight(self.embedding_dim, {0: tensor})
        head = self.head[0]
        if head is not None:
            head.share(self.weight_q)

    @property
    def complete(self) -> bool:
        return self.weight_q is not None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        check_token_ids(flat, self.num_embeddings)
        rows = self.weight_q.rows(flat.long())
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        types = "" if self.weight_q is None else ",".join(_type_names(self.weight_q.types))
        return f"{self.num_embeddings}, {self.embedding_dim}, {types}"


def quantizes_activations(model: nn.Module | None) -> bool:
    """Whether a linear of `model` computes on int8 activations (results then move with the
    last bits of their inputs: engine/core/recompute.py)."""
    modules = model.modules() if model is not None else ()
    return any(isinstance(m, QuantLinear) and m.int8_activations for m in modules)


def _type_names(ids: list[int]) -> list[str]:
    names = {v: k for k, v in QUANT_TYPES.items()}
    return [names.get(i, str(i)) for i in ids]
