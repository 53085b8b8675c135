"""oneDNN-packed linear layers against torch's, and which layers get packed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers.linear import PackedLinear, StreamedHead, pack_linears, row_bucket, warm_up


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


def test_auto_packs_float32_linears_and_streams_a_tied_head():
    model = Tiny(tied=True)
    assert pack_linears(model, "auto", torch.device("cpu")) == 1
    assert isinstance(model.proj, PackedLinear)
    # The head is the embedding table: no packed copy, the same tensor, streamed.
    assert isinstance(model.head, StreamedHead) and model.head.weight is model.embed.weight
    untied = Tiny(tied=False)
    assert pack_linears(untied, "auto", torch.device("cpu")) == 2
    warm_up(untied, max_rows=70)  # builds every bucket up to 70 rows without error


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_streamed_head_matches_torch_on_both_paths(rows):
    """Up to 8 rows through the C++ kernel (which must build here), more through F.linear."""
    torch.manual_seed(rows)
    table = nn.Embedding(1000, 64)
    head = nn.Linear(64, 1000, bias=False)
    head.weight = table.weight
    streamed = StreamedHead(head)
    assert "rows_gemv" in repr(streamed)
    with torch.inference_mode():
        x = torch.randn(rows, 64)
        torch.testing.assert_close(streamed(x), head(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(streamed(x.view(rows, 1, 64)), head(x).view(rows, 1, -1))


def test_torch_backend_and_half_precision_under_auto_stay_unpacked():
    model = Tiny(tied=False)
    assert pack_linears(model, "torch", torch.device("cpu")) == 0
    half = Tiny(tied=False).to(torch.bfloat16)
    assert pack_linears(half, "auto", torch.device("cpu")) == 0
    assert type(half.proj) is nn.Linear


def test_bad_linear_backend_is_refused():
    with pytest.raises(ValueError, match="unknown linear backend 'mkl'"):
        pack_linears(Tiny(tied=False), "mkl", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CPU device"):
        pack_linears(Tiny(tied=False), "onednn", torch.device("meta"))
