"""Triton kernels for GPUs (and, under TRITON_INTERPRET=1, CPUs); the modules that hold them
import Triton and are imported lazily, by the backends that launch them."""

from __future__ import annotations

import contextlib
import os

import torch


def interpreted() -> bool:
    """Whether this process runs Triton kernels in Triton's interpreter (on the CPU). Triton
    reads the variable when a kernel is defined: set it before the kernels are imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it `device` for an engine on another
    GPU than the first (no-op for cuda:0, "cuda" and the CPU)."""
    if device.type == "cuda" and device.index:
        return torch.cuda.device(device)
    return contextlib.nullcontext()
