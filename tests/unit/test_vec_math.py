"""The kernels' vectorized e^x (csrc/vec_math.h), through the fused decode step's SiLU * up."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.layers import cpu_kernels


@pytest.mark.parametrize("width", [16, 37, 1536])  # whole vectors, a tail, SmolLM2's width
def test_silu_and_mul_matches_torch_within_float_rounding(width):
    torch.manual_seed(width)
    gate = torch.randn(5, width) * 6  # both signs, |x| up to ~25: e^-x from 1e-11 to 1e11
    up = torch.randn(5, width)
    got = cpu_kernels.load().silu_and_mul(torch.cat([gate, up], dim=1))
    expected = (F.silu(gate.double()) * up.double()).float()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_silu_and_mul_at_the_edges_of_exp():
    """Past the clamp e^x stays finite: silu(x) -> x for large x, -> -0ish for very negative
    ones, never NaN from inf/inf; NaN in, NaN out."""
    gate = torch.tensor([[0.0, 87.5, 88.0, 100.0, 1e4, -87.5, -88.0, -100.0, -1e4, float("nan")]])
    up = torch.ones_like(gate)
    got = cpu_kernels.load().silu_and_mul(torch.cat([gate, up], dim=1))[0]
    assert got[0].item() == 0.0
    torch.testing.assert_close(got[1:5], gate[0, 1:5], rtol=1e-6, atol=0.0)
    assert torch.all(got[5:9].abs() < 1e-30) and torch.all(got[5:9] <= 0)
    assert math.isnan(got[9].item())


def test_silu_and_mul_refuses_odd_widths():
    with pytest.raises(RuntimeError, match=r"\[M, 2n\]"):
        cpu_kernels.load().silu_and_mul(torch.zeros(2, 7))
