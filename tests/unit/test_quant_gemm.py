"""Linears on llama.cpp's quantized blocks (csrc/quant_gemm.h) against the definitions.

Q4_0, Q4_1 and Q8_0 blocks come from the `gguf` package's own quantizer (what llama.cpp writes);
it cannot quantize the K types, whose blocks are random bytes (every byte pattern is a valid
block, its scales aside, set to sane float16s). Either way the reference dequantization is the
`gguf` package's, so the kernel reads the file's format, not one of ours. With int8
activations, three references:
- the same integer arithmetic in float64: activations quantized per block of 32 exactly as the
  kernel does, times the dequantized weights — equal to float32 rounding;
- the portable loop: the AVX-512 VNNI kernel (what this machine runs) and the AVX2 kernel (what
  CPUs without AVX-512 VNNI run) are bit-equal to it;
- dequantize-then-matmul in float32 (the float path): close, the difference being activation
  quantization, which `pdserve bench perplexity` measures on a real model.
With float activations (`quantized_float`): the blocked float32 kernel on the dequantized
matrix, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.layers import cpu_kernels
from engine.layers.quantized import QUANT_TYPES, BlockKernels, QuantizedTensor
from engine.testing.gguf_writer import random_k_blocks

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernel splits columns over threads

TYPES = list(QUANT_TYPES)
K_TYPES = {"Q4_K", "Q5_K", "Q6_K"}


@pytest.fixture(scope="module")
def kernel():
    return cpu_kernels.load()


def build_weight(kernel, in_features: int, parts, float_activations: bool = False):
    return BlockKernels(kernel, float_activations).weight(in_features, parts)


def _blocks(weight: torch.Tensor, type_name: str) -> tuple[QuantizedTensor, torch.Tensor]:
    """GGUF rows of `weight` in `type_name` (K types: random blocks of its shape), and their
    dequantization (the float path's W)."""
    qtype = GGMLQuantizationType[type_name]
    if type_name in K_TYPES:
        raw = random_k_blocks(qtype, *weight.shape, seed=weight.shape[0] * 31 + weight.shape[1])
    else:
        raw = quants.quantize(weight.numpy(), qtype)
    dequantized = quants.dequantize(raw, qtype).reshape(weight.shape).astype(np.float32)
    tensor = QuantizedTensor(
        torch.from_numpy(raw.reshape(weight.shape[0], -1)), type_name, weight.shape[1], "w"
    )
    return tensor, torch.from_numpy(dequantized)


def _in_features(type_name: str, in_features: int) -> int:
    """K types hold 256 weights a block: widths rounded up to whole blocks."""
    return -(-in_features // 256) * 256 if type_name in K_TYPES else in_features


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it, back in floats: per block of 32, d = max|x| / 127 and
    q = round(x * (1 / d)) (float32, ties to even)."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).double() * d.double()).view(rows, k)


# Output widths around the 16-column tile (tails padded with zero scales), input widths of one
# to many blocks, row counts across the 8-row register tile and its tails.
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (37, 64), (33, 96), (80, 576)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32])
def test_matmul_on_blocks_equals_its_definition(kernel, type_name, out_features, in_features, rows):
    in_features = _in_features(type_name, in_features)
    torch.manual_seed(out_features * 1000 + in_features + rows)
    tensor, dequantized = _blocks(torch.randn(out_features, in_features), type_name)
    weight = build_weight(kernel, in_features, {0: tensor})
    x = torch.randn(rows, in_features) * 3
    bias, residual = torch.randn(out_features), torch.randn(rows, out_features)
    got = weight.forward(x, bias, residual)
    exact = _quantized_activations(x) @ dequantized.double().T + bias.double() + residual.double()
    # float32 accumulation over the sub-blocks: errors relative to the outputs' scale
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max())
    portable = weight.forward(x, bias, residual, kernel="portable")
    assert torch.equal(got, portable)
    assert torch.equal(weight.forward(x, bias, residual, kernel="avx2"), portable)
    float_path = x @ dequantized.T + bias + residual
    assert ((got - float_path).norm() / float_path.norm()).item() < 0.02


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (37, 64), (80, 576)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 32])
def test_float_activations_give_the_blocked_float_kernels_bits(
    kernel, type_name, out_features, in_features, rows
):
    in_features = _in_features(type_name, in_features)
    torch.manual_seed(out_features + in_features * 7 + rows)
    tensor, dequantized = _blocks(torch.randn(out_features, in_features), type_name)
    weight = build_weight(kernel, in_features, {0: tensor}, float_activations=True)
    assert weight.float_activations
    x = torch.randn(rows, in_features)
    bias, residual = torch.randn(out_features), torch.randn(rows, out_features)
    got = weight.forward(x, bias, residual)
    packed = kernel.pack_blocked(dequantized)
    assert torch.equal(got, kernel.blocked_linear(x, packed, out_features, bias, residual))
    assert torch.equal(got, weight.forward(x, bias, residual, kernel="portable"))


@pytest.mark.parametrize("type_name", TYPES)
def test_parts_in_different_types_stack_like_one_matrix(kernel, type_name):
    torch.manual_seed(1)
    other = "Q8_0" if type_name != "Q8_0" else "Q4_0"
    q, dq_q = _blocks(torch.randn(24, 256), type_name)
    v, dq_v = _blocks(torch.randn(8, 256), other)
    weight = build_weight(kernel, 256, {1: v, 0: q})  # handed over out of order
    assert weight.out_features == 32 and weight.types == [
        QUANT_TYPES[type_name],
        QUANT_TYPES[other],
    ]
    x = torch.randn(5, 256)
    exact = _quantized_activations(x) @ torch.cat([dq_q, dq_v]).double().T
    torch.testing.assert_close(weight.forward(x).double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_are_the_float_paths_rows_exactly(kernel, type_name):
    torch.manual_seed(2)
    width = _in_features(type_name, 96)
    tensor, dequantized = _blocks(torch.randn(50, width), type_name)
    weight = build_weight(kernel, width, {0: tensor})
    ids = torch.tensor([0, 49, 17, 16, 17])
    assert torch.equal(weight.rows(ids), dequantized[ids])


@pytest.mark.parametrize(("type_name", "in_features"), [("Q4_1", 64), ("Q8_0", 64), ("Q5_K", 256)])
def test_tiles_take_about_the_files_bytes(kernel, type_name, in_features):
    """Tiles hold the blocks' bytes (Q5_K: a byte per 5-bit code, 1.57x), padded to 16 rows."""
    tensor, _ = _blocks(torch.randn(24, in_features), type_name)
    weight = build_weight(kernel, in_features, {0: tensor})
    growth = {"Q4_1": 1.0, "Q8_0": 1.0, "Q5_K": (320 + 8 * 512) / (16 * 176)}[type_name]
    assert weight.nbytes == pytest.approx(tensor.raw.shape[1] * 32 * growth)


def test_zero_activations_and_zero_rows(kernel):
    """A zero block of x has scale 0 (no division by zero); zero rows (a padded vocabulary's)
    give zeros."""
    raw = torch.zeros(20, 2 * 20, dtype=torch.uint8)  # Q4_1: 20 bytes per block, d = m = 0
    weight = build_weight(kernel, 64, {0: QuantizedTensor(raw, "Q4_1", 64, "w")})
    x = torch.zeros(2, 64)
    x[1, 40] = 5.0
    assert torch.equal(weight.forward(x), torch.zeros(2, 20))


def test_misshapen_weights_are_refused(kernel):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.QuantWeight(48)
    weight = kernel.QuantWeight(64)
    with pytest.raises(RuntimeError, match="raw rows must be"):
        weight.add(torch.zeros(4, 30, dtype=torch.uint8), QUANT_TYPES["Q8_0"])
    with pytest.raises(RuntimeError, match="unsupported block type"):
        weight.add(torch.zeros(4, 40, dtype=torch.uint8), 10)  # Q2_K
    with pytest.raises(RuntimeError, match="multiple of 256"):  # K types: 256 weights a block
        weight.add(torch.zeros(4, 144, dtype=torch.uint8), QUANT_TYPES["Q4_K"])
    weight.add(torch.zeros(4, 68, dtype=torch.uint8), QUANT_TYPES["Q8_0"])
    with pytest.raises(RuntimeError, match="x must be float32"):
        weight.forward(torch.zeros(2, 32))
    with pytest.raises(RuntimeError, match="outside the table"):
        weight.rows(torch.tensor([4]))


def test_this_machine_runs_the_vector_kernels(kernel):
    """The CI machine has AVX-512 VNNI and AVX2: the kernels the tests above hold to the
    portable loop are the ones engines run here and on AVX2-only CPUs."""
    flags = cpu_kernels._cpu_flags().split()
    expected = ["avx512_vnni"] if {"avx512_vnni", "avx512f"} <= set(flags) else []
    expected += ["avx2"] if "avx2" in flags else []
    assert kernel.quant_int8_kernels() == [*expected, "portable"]
    with pytest.raises(RuntimeError, match="kernel must be"):
        kernel.QuantWeight(32).forward(torch.zeros(1, 32), kernel="sse")
