"""RMSNorm, computed in float32 as Hugging Face does (the parity oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel computes x * rsqrt(mean(x^2) + eps) in float32 with the same
        # rounding as the unfused HF expression (several times faster on long prefills).
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Half precision: HF rounds the normalised value to x's dtype before the weight.
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)
