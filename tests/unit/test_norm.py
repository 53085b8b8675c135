"""RMSNorm uses torch's fused kernel; the parity oracle is HF's unfused float32 expression."""

from __future__ import annotations

import pytest
import torch

from engine.layers.norm import RMSNorm


def hf_rms_norm(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 64), (33, 4, 128), (300, 256)])
def test_rms_norm_is_bitwise_equal_to_the_hf_expression(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data = torch.randn(shape[-1], generator=gen).to(dtype)
    for scale in (0.0, 0.01, 1.0, 30.0):
        x = (torch.randn(shape, generator=gen) * scale).to(dtype)
        out = norm(x)
        assert out.dtype == dtype
        assert torch.equal(out, hf_rms_norm(norm.weight, x, 1e-6))
