"""Linear layers on CPUs: float32 weights packed once after loading, never re-packed per call.

torch's CPU linear goes to MKL's sgemm, which copies the weight matrix into its blocked layout
on every call — at decode batch sizes the copy costs as much as the multiply. Two packed forms,
each replacing the dense weight (one copy of every matrix):

- `BlockedLinear` (backend `blocked`, the default on CPUs): column blocks read by our C++
  kernel (csrc/blocked_gemm.h). Fastest where decode lives — at one row it reads weights at
  ~1.4x oneDNN's speed, at 32 rows it is on par — and its weights are what the fused decode
  step (engine/models/llama_fused.py) reads. Long prefills run ~1.4x slower than oneDNN.
- `PackedLinear` (backend `onednn`): oneDNN's opaque blocked layout, JIT-compiled for the CPU;
  the better choice for an engine that only prefills.

A tied output head is also the embedding table. Where the kernels build it becomes a
`BlockedLinear` like any other, and the embedding a `BlockedEmbedding` that gathers its rows
from the same column blocks: the table is stored once, in the layout the head's GEMM wants (on
the CI machine's 2 cores, SmolLM2's 49152 x 576 head: 3.7 ms at one row against 4.3 for a
row-major streaming kernel, 10.0 against 15.3 at 32 rows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from engine.layers import cpu_kernels

# "quantized", "quantized_float": GGUF matrices compute on their blocks
# (engine/layers/quantized.py; chosen at load, before packing), the rest as under "auto".
LINEAR_BACKENDS = ("auto", "torch", "onednn", "blocked", "quantized", "quantized_float")
_EXACT_ROWS = 64
_WARM_UP_MAX_ELEMENTS = 1 << 23

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout (any number of rows, any leading dims)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # The batch-size hint only picks the blocking; any row count is accepted afterwards.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._op = torch.ops.mkldnn._linear_pointwise.default  # resolved once: ~3 us a call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= _EXACT_ROWS:  # decode steps: nothing to reshape
            return self._op(x, self.packed, self.bias, "none", [], "")
        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = self._op(x, self.packed, self.bias, "none", [], "")
        return out[:rows].view(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def stacked_rows(shard_sizes: list[int], index: int) -> slice:
    """The output rows of projection `index` in a layer stacking projections of these sizes."""
    start = sum(shard_sizes[:index])
    return slice(start, start + shard_sizes[index])


def rows_through(
    call: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out_features: int,
    name: str,
) -> torch.Tensor:
    """A kernel linear over any leading dims: `call(rows, residual rows)` on x as rows with
    contiguous columns, its output back in x's leading shape; named `name` in profiler traces."""
    leading = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if residual is not None:
        residual = residual.reshape(-1, out_features)
    with record_function(name):
        out = call(rows, residual)
    return out.view(*leading, out_features)


def check_token_ids(flat: torch.Tensor, num_embeddings: int) -> None:
    """nn.Embedding's IndexError for ids outside the table (a kernel's lookup would read
    padding, wrap, or fail less clearly)."""
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_embeddings):
        raise IndexError(f"token id outside the embedding table of {num_embeddings}")


class _ColumnBlocks(nn.Module):
    """A linear layer whose W a kernel packs once in column blocks of 16 (`_pack`) and
    multiplies with `_op`; `residual` adds a skip connection in the same pass (any number of
    rows, any leading dims)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    _pack = _op = _label = ""

    def __init__(self, linear: nn.Linear, kernel: Any) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._kernel = kernel
        self.register_buffer("packed", getattr(kernel, self._pack)(linear.weight.detach()), False)
        bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.register_buffer("bias", bias, False)
        self._call = getattr(kernel, self._op)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        def call(rows: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
            return self._call(rows, self.packed, self.out_features, self.bias, res)

        return rows_through(call, x, residual, self.out_features, f"pdserve::{self._op}")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._label}"


class BlockedLinear(_ColumnBlocks):
    """y = x W^T + b, float32, with W in column blocks [N/16, K, 16] (csrc/blocked_gemm.h)."""

    _pack, _op, _label = "pack_blocked", "blocked_linear", "blocked"


class BF16Linear(_ColumnBlocks):
    """y = x W^T + b for bfloat16 engines on CPUs with AVX-512 BF16 (csrc/bf16_gemm.h): W in
    column blocks of pairs [N/16, K/2, 16, 2], packed once; float32 accumulation, the output
    rounded to bfloat16 once, as torch's bfloat16 linear does (at one row ~2x its speed)."""

    _pack, _op, _label = "pack_bf16", "bf16_linear", "bf16 pairs"


class BlockedEmbedding(nn.Module):
    """The embedding table of a tied head packed as a `BlockedLinear` (or a `BF16Linear`):
    token j's row is lane j % 16 of block j // 16 over every k (of every pair of k). The gather
    copies values, so rows are exactly the table's; the head and the embedding share one
    tensor."""

    packed: torch.Tensor

    def __init__(self, head: BlockedLinear | BF16Linear) -> None:
        super().__init__()
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features
        self.register_buffer("packed", head.packed, False)  # the head's tensor, not a copy

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        check_token_ids(flat, self.num_embeddings)
        width = self.packed.shape[2]  # output columns per block
        block = torch.div(flat, width, rounding_mode="floor")
        rows = self.packed[block, :, flat - block * width]  # [tokens, k] or [tokens, k/2, 2]
        rows = rows.reshape(flat.numel(), -1)[:, : self.embedding_dim]  # an odd k's zero pair
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocked (the tied head's tensor)"


def _cpu_kernels() -> Any:
    try:
        return cpu_kernels.load()
    except cpu_kernels.KernelBuildError as exc:
        logger.warning("%s; linears use oneDNN or torch", exc)
        return None


def row_bucket(rows: int) -> int:
    """The row count a GEMM runs with. oneDNN builds (JIT-compiles) one primitive per shape,
    ~0.5 ms each, and caches 1,024: decode batches keep their exact size, longer inputs are
    padded to one of 8 sizes per power of two (at most 12.5% padding), so a server sees a few
    hundred shapes, not one per prompt length."""
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)  # 8 steps per octave
    return -(-rows // step) * step


def warm_up(model: nn.Module, max_rows: int) -> None:
    """Build the primitives of every decode-sized bucket now, not on the first requests.
    Only for small matrices: where one GEMM takes far longer than building its primitive,
    warming would cost seconds to save nothing noticeable."""
    by_shape: dict[tuple[int, int, bool], PackedLinear] = {}
    for module in model.modules():
        if not isinstance(module, PackedLinear):
            continue
        if module.in_features * module.out_features <= _WARM_UP_MAX_ELEMENTS:
            key = (module.in_features, module.out_features, module.bias is not None)
            by_shape.setdefault(key, module)
    sizes = sorted({row_bucket(n) for n in range(1, max_rows + 1)})
    with torch.inference_mode():
        for module in by_shape.values():
            for rows in sizes:
                module(torch.zeros(rows, module.in_features, dtype=module.packed.dtype))


def pack_linears(model: nn.Module, backend: str, device: torch.device) -> int:
    """Swap the model's nn.Linear layers for packed ones where `backend` says so; returns how
    many were packed. `auto`: on a CPU, float32 weights go to `blocked` (to `onednn` where the
    kernels cannot be built), bfloat16 ones to `BF16Linear` where the CPU has AVX-512 BF16,
    anything else stays; `blocked` and `onednn` insist (ValueError where they cannot); `torch`
    leaves every layer alone. A tied head goes to `blocked` (or `BF16Linear`) under any
    packing backend, its embedding with it (`BlockedEmbedding`)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; choose from {LINEAR_BACKENDS}")
    if backend == "torch":
        return 0
    if device.type != "cpu":
        if backend == "auto":
            return 0
        raise ValueError(f"linear backend {backend!r} needs a CPU device")
    make = _packer(backend)
    if make is None:
        return 0
    heads: dict[int, BlockedLinear | BF16Linear] = {}  # by the id of the weight a head shares
    packed = _swap_linears(model, backend, make, heads)
    _embed_from_heads(model, heads)  # also after an early stop: a packed head keeps one table
    return packed


def _swap_linears(
    model: nn.Module,
    backend: str,
    make: Callable[[nn.Linear], nn.Module],
    heads: dict[int, BlockedLinear | BF16Linear],
) -> int:
    """pack_linears' swap of every nn.Linear; tied heads it blocks are added to `heads`."""
    tied = _tied_output_heads(model)
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if id(child) in tied:
                head = _blocked_head(child)
                if head is not None:
                    setattr(parent, name, head)
                    heads[id(child.weight)] = head
                    packed += 1
                continue
            if child.weight.dtype == torch.bfloat16 and backend != "onednn":
                bf16 = _bf16_linear(child)
                if bf16 is None and backend == "blocked":
                    raise ValueError(_BLOCKED_DTYPES)
                if bf16 is not None:
                    setattr(parent, name, bf16)
                    packed += 1
                continue
            if child.weight.dtype != torch.float32 and backend != "onednn":
                if backend == "blocked":
                    raise ValueError(_BLOCKED_DTYPES)
                continue
            try:
                setattr(parent, name, make(child))
            except RuntimeError as exc:  # e.g. bf16 on a CPU without bf16 support
                if backend == "onednn":
                    raise ValueError(f"linear backend 'onednn' cannot pack {name}: {exc}") from exc
                logger.warning("cannot pack %s (%s); keeping torch's linears", name, exc)
                return packed  # the others would fail the same way
            packed += 1
    return packed


_BLOCKED_DTYPES = (
    "linear backend 'blocked' needs float32 weights, or bfloat16 ones on a CPU with AVX-512 BF16"
)


def _blocked_head(linear: nn.Linear) -> BlockedLinear | BF16Linear | None:
    """A tied float32 (bfloat16) head in column blocks (whatever the backend: oneDNN has no
    way to share the table with the embedding); None where the kernels cannot build."""
    if linear.bias is not None:
        return None
    if linear.weight.dtype == torch.bfloat16:
        return _bf16_linear(linear)
    if linear.weight.dtype != torch.float32:
        return None
    kernel = _cpu_kernels()
    return None if kernel is None else BlockedLinear(linear, kernel)


def _bf16_linear(linear: nn.Linear) -> BF16Linear | None:
    """`linear` packed for AVX-512 BF16, or None where this CPU or build has no such kernel."""
    kernel = _cpu_kernels()
    if kernel is None or not kernel.bf16_available():
        return None
    return BF16Linear(linear, kernel)


def _embed_from_heads(model: nn.Module, heads: dict[int, BlockedLinear | BF16Linear]) -> None:
    """Each embedding whose table became a blocked head reads it there; the row-major table
    is then referenced by nothing and freed."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding) and id(child.weight) in heads:
                assert child.max_norm is None, "a tied table with max_norm is not supported"
                setattr(parent, name, BlockedEmbedding(heads[id(child.weight)]))


def _packer(backend: str) -> Callable[[nn.Linear], nn.Module] | None:
    """What packs one layer for `backend` on this machine (None: nothing can, under auto)."""
    kernel = _cpu_kernels() if backend in ("auto", "blocked") else None
    if kernel is not None:
        return lambda linear: BlockedLinear(linear, kernel)
    if backend == "blocked":
        raise ValueError("linear backend 'blocked': the CPU kernels cannot be built here")
    if not torch.backends.mkldnn.is_available():
        if backend == "onednn":
            raise ValueError("linear backend 'onednn': this torch build has no oneDNN")
        return None
    return PackedLinear


def _tied_output_heads(model: nn.Module) -> set[int]:
    """Linear layers whose weight is also an embedding table."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        id(m) for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embeddings
    }
