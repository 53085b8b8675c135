"""Packed linear layers (column-blocked, oneDNN) against torch's, and which layers get packed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers import cpu_kernels
from engine.layers.linear import (
    BF16Linear,
    BlockedEmbedding,
    BlockedLinear,
    PackedLinear,
    pack_linears,
    row_bucket,
    warm_up,
)

# The CPU kernels split their work between threads: run them with two (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("two_threads")


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 100, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 48)
    got = packed(x)
    assert got.shape == (rows, 80)  # rows padded to a bucket are cut off again
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


# Output widths around the 16-column block (padding) and the 3-block wide tile, input widths off
# the 8-lane vector, and row counts across the narrow 3-row tile, the switch to 8-row wide tiles
# at 8 rows and their tails, and the 64-row panel.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 8, 9, 13, 16, 64, 65, 130])
@pytest.mark.parametrize(("in_features", "out_features"), [(48, 80), (37, 15), (64, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_linear_matches_torch(rows, in_features, out_features, bias):
    torch.manual_seed(rows * out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    blocked = BlockedLinear(linear, cpu_kernels.load())
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        got = blocked(x)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        # The residual is added in the same pass; leading dimensions are kept.
        residual = torch.randn(rows, out_features)
        torch.testing.assert_close(blocked(x, residual), linear(x) + residual, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(blocked(x.view(1, rows, -1)), linear(x).view(1, rows, -1))


@pytest.mark.parametrize("rows", [7, 8, 32, 100])
def test_blocked_linear_rows_do_not_change_results(rows):
    """Seven rows go through k in chunks and narrow tiles, 8 or more through wide 16-lane tiles,
    one row through one whole column in 8-lane vectors: each output is still one chain of
    multiply-adds in the same order, so each row equals itself computed alone, bit for bit (a
    batch never changes a request's logits)."""
    torch.manual_seed(rows)
    linear = nn.Linear(576, 200, bias=True)  # k over several chunks, a partial last block
    blocked = BlockedLinear(linear, cpu_kernels.load())
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        together = blocked(x)
        alone = torch.cat([blocked(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)
    torch.testing.assert_close(together, linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 3), (16, 8), (20, 8), (200, 576), (33, 1)])
def test_pack_blocked_lays_rows_out_in_column_blocks_padded_with_zeros(shape):
    """W [N, K] -> [ceil(N/16), K, 16]: lane j of block b over k is row 16b + j; lanes past N
    are zero (the GEMM reads them); a non-contiguous W is packed by its values."""
    n, k = shape
    weight = torch.randn(k, n).t()  # non-contiguous
    blocks = -(-n // 16)
    expected = torch.zeros(blocks * 16, k)
    expected[:n] = weight
    expected = expected.view(blocks, 16, k).transpose(1, 2)
    assert torch.equal(cpu_kernels.load().pack_blocked(weight), expected)


def test_blocked_linear_refuses_mismatched_inputs():
    kernel = cpu_kernels.load()
    packed = kernel.pack_blocked(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.blocked_linear(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.blocked_linear(torch.randn(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="residual must be"):
        kernel.blocked_linear(torch.randn(2, 8), packed, 20, None, torch.randn(2, 19))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.blocked_linear(torch.randn(2, 8).double(), packed, 20)


def test_packed_linear_keeps_leading_dimensions():
    linear = nn.Linear(16, 8)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_row_buckets_bound_padding_and_shape_count():
    buckets = [row_bucket(n) for n in range(1, 8193)]
    assert buckets[:64] == list(range(1, 65))  # decode batches run at their exact size
    assert all(b >= n and b <= n * 1.125 for n, b in enumerate(buckets, start=1))
    assert len(set(buckets)) <= 128  # a few hundred oneDNN primitives at most, not 8192


class Tiny(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_auto_blocks_float32_linears_and_a_tied_head_with_its_embedding():
    model = Tiny(tied=True)
    table = model.embed.weight.detach().clone()
    assert pack_linears(model, "auto", torch.device("cpu")) == 2
    assert isinstance(model.proj, BlockedLinear) and isinstance(model.head, BlockedLinear)
    assert not any(isinstance(b, nn.Parameter) for b in model.proj.buffers())  # one copy
    # The embedding reads the head's blocks: one tensor, and no row-major table left.
    assert isinstance(model.embed, BlockedEmbedding)
    assert model.embed.packed is model.head.packed
    assert not any(p.shape == table.shape for p in model.parameters())
    untied = Tiny(tied=False)
    assert pack_linears(untied, "auto", torch.device("cpu")) == 2
    assert isinstance(untied.head, BlockedLinear) and isinstance(untied.embed, nn.Embedding)


def test_onednn_backend_packs_for_onednn_but_blocks_a_tied_head():
    untied = Tiny(tied=False)
    assert pack_linears(untied, "onednn", torch.device("cpu")) == 2
    assert isinstance(untied.proj, PackedLinear) and isinstance(untied.head, PackedLinear)
    warm_up(untied, max_rows=70)  # builds every bucket up to 70 rows without error
    tied = Tiny(tied=True)
    assert pack_linears(tied, "onednn", torch.device("cpu")) == 2
    assert isinstance(tied.proj, PackedLinear) and isinstance(tied.head, BlockedLinear)
    assert isinstance(tied.embed, BlockedEmbedding)


# Vocabularies off the 16-row block (a padded last block), ids at both ends and repeated.
@pytest.mark.parametrize("vocab", [1000, 1024, 17])
def test_blocked_embedding_gives_the_tables_rows_exactly(vocab):
    torch.manual_seed(vocab)
    table = nn.Embedding(vocab, 24)
    head = nn.Linear(24, vocab, bias=False)
    head.weight = table.weight
    blocked = BlockedLinear(head, cpu_kernels.load())
    embedding = BlockedEmbedding(blocked)
    ids = torch.tensor([[0, vocab - 1, 5 % vocab], [16 % vocab, 15 % vocab, 5 % vocab]])
    with torch.inference_mode():
        assert torch.equal(embedding(ids), table(ids))  # a gather: the very floats
        assert embedding(ids).shape == (2, 3, 24)
        assert torch.equal(embedding(torch.arange(vocab)), table.weight)
        x = torch.randn(5, 24)
        torch.testing.assert_close(blocked(x), head(x), rtol=1e-5, atol=1e-5)
        for bad in (vocab, -1):  # padding rows of the last block, or a wrap: refused, as torch does
            with pytest.raises(IndexError, match="outside the embedding table"):
                embedding(torch.tensor([0, bad]))


def test_torch_backend_and_float16_under_auto_stay_unpacked():
    model = Tiny(tied=False)
    assert pack_linears(model, "torch", torch.device("cpu")) == 0
    half = Tiny(tied=False).to(torch.float16)
    assert pack_linears(half, "auto", torch.device("cpu")) == 0
    assert type(half.proj) is nn.Linear
    with pytest.raises(ValueError, match="'blocked' needs float32 weights, or bfloat16"):
        pack_linears(Tiny(tied=False).to(torch.float16), "blocked", torch.device("cpu"))


def _has_bf16() -> bool:
    return "avx512_bf16" in cpu_kernels._cpu_flags().split()


@pytest.mark.skipif(not _has_bf16(), reason="needs AVX-512 BF16 (the CI machine has it)")
def test_bfloat16_linears_and_a_tied_head_pack_for_avx512_bf16():
    kernel = cpu_kernels.load()
    assert kernel.bf16_available()
    model = Tiny(tied=True).to(torch.bfloat16)
    table = model.embed.weight.detach().clone()
    assert pack_linears(model, "auto", torch.device("cpu")) == 2
    assert isinstance(model.proj, BF16Linear) and isinstance(model.head, BF16Linear)
    assert isinstance(model.embed, BlockedEmbedding) and model.embed.packed is model.head.packed
    ids = torch.tensor([[0, 17, 31], [5, 5, 16]])
    assert torch.equal(model.embed(ids), table[ids])  # the table's rows, exactly


def test_bfloat16_without_the_instructions_stays_torch_or_is_refused(monkeypatch):
    kernel = cpu_kernels.load()
    monkeypatch.setattr(kernel, "bf16_available", lambda: False)
    model = Tiny(tied=False).to(torch.bfloat16)
    assert pack_linears(model, "auto", torch.device("cpu")) == 0
    assert type(model.proj) is nn.Linear
    with pytest.raises(ValueError, match="bfloat16 ones on a CPU with AVX-512 BF16"):
        pack_linears(Tiny(tied=False).to(torch.bfloat16), "blocked", torch.device("cpu"))


# Odd input widths (the zero pair), output widths off the 16-column block, rows across the
# 8-row tile.
@pytest.mark.skipif(not _has_bf16(), reason="needs AVX-512 BF16 (the CI machine has it)")
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32])
@pytest.mark.parametrize(("in_features", "out_features"), [(16, 32), (65, 37), (576, 80)])
def test_bf16_linear_rounds_like_torchs(rows, in_features, out_features):
    torch.manual_seed(rows + in_features)
    linear = nn.Linear(in_features, out_features).to(torch.bfloat16)
    packed = BF16Linear(linear, cpu_kernels.load())
    x = torch.randn(rows, in_features).bfloat16()
    residual = torch.randn(rows, out_features).bfloat16()
    exact = x.double() @ linear.weight.double().T + linear.bias.double() + residual.double()
    got = packed(x, residual).double()
    # float32 accumulation, one rounding to bfloat16 (8 bits): within two of its steps
    torch.testing.assert_close(got, exact, rtol=2 * 2**-8, atol=1e-2)
    theirs = (linear(x) + residual).double()  # torch rounds twice: after the GEMM, after +
    assert (got - exact).abs().mean() <= (theirs - exact).abs().mean() * 1.1


def test_bad_linear_backend_is_refused():
    with pytest.raises(ValueError, match="unknown linear backend 'mkl'"):
        pack_linears(Tiny(tied=False), "mkl", torch.device("cpu"))
    for backend in ("onednn", "blocked"):
        with pytest.raises(ValueError, match="needs a CPU device"):
            pack_linears(Tiny(tied=False), backend, torch.device("meta"))


def test_blocked_backend_refuses_where_the_kernels_cannot_build(monkeypatch, caplog):
    def fail():
        raise cpu_kernels.KernelBuildError("cannot build the CPU kernels: no compiler")

    monkeypatch.setattr(cpu_kernels, "load", fail)
    with pytest.raises(ValueError, match="'blocked': the CPU kernels cannot be built"):
        pack_linears(Tiny(tied=False), "blocked", torch.device("cpu"))
    model = Tiny(tied=False)
    assert pack_linears(model, "auto", torch.device("cpu")) == 2  # auto falls back to oneDNN
    assert isinstance(model.proj, PackedLinear)
    assert "no compiler" in caplog.text


def test_prefill_engines_pack_for_onednn_on_cpus_unless_told_otherwise(tmp_path):
    from deployments.replica.engine_server import DecodeServer, PrefillServer
    from engine.models.catalog import resolve_model
    from engine.testing.gguf_writer import write_gguf

    assert PrefillServer.role_engine_args("tiny", {"max_model_len": 64}) == {
        "max_model_len": 64,
        "linear_backend": "onednn",  # no GPU here: "auto" means a CPU
    }
    assert PrefillServer.role_engine_args("tiny", {"device": "cpu"})["linear_backend"] == "onednn"
    explicit = {"linear_backend": "blocked"}
    assert PrefillServer.role_engine_args("tiny", explicit) == explicit
    on_gpu = {"device": "cuda"}
    assert PrefillServer.role_engine_args("tiny", on_gpu) == on_gpu
    # A GGUF's quantized blocks stay quantized (auto): the decode side computes the same KV.
    gguf = str(write_gguf(resolve_model("tiny"), tmp_path / "q.gguf", "Q8_0"))
    assert PrefillServer.role_engine_args(gguf, {}) == {}
    # ... where auto keeps them: not for a bfloat16 engine, which packs for oneDNN as before
    bf16 = PrefillServer.role_engine_args(gguf, {"dtype": "bfloat16"})
    assert bf16["linear_backend"] == "onednn"
    assert DecodeServer.role_engine_args("tiny", {}) == {}  # auto: blocked + fused
