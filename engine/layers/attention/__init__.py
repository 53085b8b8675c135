"""Attention backends behind one interface; GPU-only ones are imported lazily."""

from __future__ import annotations

import logging

import torch

from engine.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillSlice
from engine.layers.attention.torch_ref import TorchReferenceBackend

BACKENDS = ("torch", "cpu", "cuda", "triton")

logger = logging.getLogger(__name__)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`torch` runs anywhere; `cpu` (default on CPUs) decodes with a C++ paged kernel;
    `triton` (default on CUDA devices) reads KV blocks in place with Triton kernels, and runs
    on a CPU under Triton's interpreter; `cuda` is the earlier GPU path (SDPA over gathered
    blocks). `auto` on a CPU falls back to `torch`, with a warning, when the kernel cannot be
    built here."""
    if name == "auto":
        if device.type == "cuda":
            return get_attention_backend("triton", device)
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
    if name == "triton":
        return _triton_backend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS} or 'auto'")


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "PrefillSlice",
    "TorchReferenceBackend",
    "get_attention_backend",
]


def _triton_backend(device: torch.device) -> AttentionBackend:
    from engine.layers.gpu import interpreted

    if device.type == "cpu" and not interpreted():
        raise ValueError(
            "attention backend 'triton' on a CPU runs under Triton's interpreter: set "
            "TRITON_INTERPRET=1 before starting (slow; for tests), or use 'cpu' or 'torch'"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention backend 'triton' needs a CUDA device, not {device.type}")
    from engine.layers.attention.triton import TritonBackend

    return TritonBackend(device)
