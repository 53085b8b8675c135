"""A decoder layer's elementwise steps, behind one small interface: torch ops (the
reference, any device) or fused Triton kernels (engine/layers/gpu/fused_ops.py), picked with
the attention backend (`AttentionBackend.layer_ops`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.norm import RMSNorm


class LayerOps:
    """Torch: the residual add and the norm as two ops, SiLU and the product as two."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual yet, (norm(x), x)."""
        if residual is not None:
            x = residual + x
        return norm(x), x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of a stacked [T, 2 * inner] gate/up projection."""
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate).mul_(up)


class TritonLayerOps(LayerOps):
    """One Triton kernel each (imported on first use: the torch ops need no Triton)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.layers.gpu import fused_ops, on_device

        with on_device(self.device):
            return fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from engine.layers.gpu import fused_ops, on_device

        with on_device(self.device):
            return fused_ops.silu_mul(gate_up)


TORCH_LAYER_OPS = LayerOps()
