"""Attention backends behind one interface; GPU-only ones are imported lazily."""

from __future__ import annotations

import logging

import torch

from engine.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillSlice
from engine.layers.attention.torch_ref import TorchReferenceBackend

BACKENDS = ("torch", "cpu", "cuda")

logger = logging.getLogger(__name__)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`torch` runs anywhere; `cpu` (default on CPUs) decodes with a C++ paged kernel; `cuda`
    (default on CUDA devices) batches prefills on the GPU. `auto` on a CPU falls back to
    `torch`, with a warning, when the kernel cannot be built here."""
    if name == "auto":
        if device.type == "cuda":
            return get_attention_backend("cuda", device)
        try:
            return get_attention_backend("cpu", device)
        except ValueError as exc:
            logger.warning("%s; using the torch reference attention", exc)
            return TorchReferenceBackend()
    if name == "torch":
        return TorchReferenceBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention backend 'cpu' needs a CPU device")
        from engine.layers.attention.cpu import CpuBackend, KernelBuildError

        try:
            return CpuBackend()
        except KernelBuildError as exc:
            raise ValueError(str(exc)) from exc
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
