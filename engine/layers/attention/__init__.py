"""Attention backends behind one interface; GPU-only ones are imported lazily."""

from __future__ import annotations

import torch

from engine.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillSlice
from engine.layers.attention.torch_ref import TorchReferenceBackend

BACKENDS = ("torch", "cuda")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`torch` runs anywhere; `cuda` (default on CUDA devices) batches prefills on the GPU."""
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchReferenceBackend()
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError("attention backend 'cuda' needs a CUDA device")
        from engine.layers.attention.cuda import CudaBackend  # imported only on GPU hosts

        return CudaBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS} or 'auto'")


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "PrefillSlice",
    "TorchReferenceBackend",
    "get_attention_backend",
]
