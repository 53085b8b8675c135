"""CPU fast path: decodes read the paged KV cache in place through a small C++ kernel.

The kernel (engine/layers/csrc/paged_attention.h) is compiled on first use and cached per
machine (engine/layers/cpu_kernels.py). Prefills keep the reference path: SDPA's blocked CPU
kernel is already GEMM-shaped there. When the kernel cannot be built,
`get_attention_backend("auto", cpu)` falls back to the reference.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from engine.layers import cpu_kernels
from engine.layers.attention.backend import AttentionMetadata
from engine.layers.attention.torch_ref import TorchReferenceBackend
from engine.layers.cpu_kernels import KernelBuildError


def build_directory() -> Path:
    return cpu_kernels.build_directory()


def load_kernel() -> ModuleType:
    """Compile (once per machine) and import the kernel; KernelBuildError when impossible."""
    return cpu_kernels.load()


__all__ = ["CpuBackend", "KernelBuildError", "build_directory", "load_kernel"]


class CpuBackend(TorchReferenceBackend):
    def __init__(self) -> None:
        self.kernel = load_kernel()

    def _write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> None:
        self.kernel.write_kv(kv_cache, k, v, md.slot_block, md.slot_offset)

    def _decodes(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        only_decodes = md.num_decodes == md.num_tokens  # token i is decode i: no gather
        queries = q if only_decodes else q[md.decode_token_indices]
        attended = out if only_decodes else torch.empty_like(queries)
        self.kernel.paged_decode_attention(
            attended,
            queries,
            kv_cache,
            md.decode_block_table,
            md.decode_seq_lens,
            md.sliding_window or 0,
            scale,
        )
        if not only_decodes:
            out[md.decode_token_indices] = attended
