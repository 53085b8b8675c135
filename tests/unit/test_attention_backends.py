"""The CPU paged-decode kernel against the torch reference (the oracle), and backend choice."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.layers import cpu_kernels
from engine.layers.attention import (
    AttentionMetadata,
    PrefillSlice,
    TorchReferenceBackend,
    get_attention_backend,
)
from engine.layers.attention import cpu as cpu_attention

# The CPU kernels split their work between threads: run them with two (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("two_threads")


def decode_batch(
    seq_lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int, dtype, seed=0
):
    """A layer view of a block-contiguous cache with 3 layers, scattered block ids per request,
    and one new (decode) token per request at position seq_len - 1."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 7
    cache = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, generator=gen)
    layer = cache.to(dtype)[:, 1]
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks_per_req)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    for row, count in enumerate(blocks_per_req):
        table[row, :count] = torch.tensor([ids.pop() for _ in range(count)])
    lens = torch.tensor(seq_lens)
    last = lens - 1
    metadata = AttentionMetadata(
        num_tokens=len(seq_lens),
        block_size=block_size,
        slot_block=table.gather(1, (last // block_size).unsqueeze(1)).squeeze(1),
        slot_offset=last % block_size,
        block_table=table,
        decode_token_indices=torch.arange(len(seq_lens)),
        decode_block_table=table,
        decode_seq_lens=lens,
        prefills=[],
    )
    shape = (len(seq_lens), num_heads, head_dim)
    q = torch.randn(shape, generator=gen).to(dtype)
    k = torch.randn((len(seq_lens), num_kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((len(seq_lens), num_kv_heads, head_dim), generator=gen).to(dtype)
    return q, k, v, layer, metadata


def run_both(q, k, v, layer, metadata, window=None):
    metadata.sliding_window = window
    ref_cache, cpu_cache = layer.clone(), layer.clone()
    expected = TorchReferenceBackend().forward(q, k, v, ref_cache, metadata, 0.3)
    got = cpu_attention.CpuBackend().forward(q, k, v, cpu_cache, metadata, 0.3)
    torch.testing.assert_close(cpu_cache, ref_cache, rtol=0, atol=0)  # same K/V written
    return got, expected


@pytest.mark.parametrize(
    ("seq_lens", "heads", "head_dim", "block_size"),
    [
        ([1, 5, 17, 64, 33], (8, 4), 32, 16),  # GQA 2, lengths across block edges
        ([40], (4, 4), 64, 8),  # one request: split across kv heads
        ([3, 100, 7, 9, 250, 1, 16, 31], (12, 2), 128, 16),  # GQA 6, head_dim 128
        ([12, 13], (2, 1), 16, 4),  # MQA
        ([37, 70, 5], (6, 3), 40, 4),  # head_dim not a multiple of 16, 16-token tiles span blocks
        ([2, 45, 130], (16, 2), 64, 16),  # GQA 8: V weighed 4 query heads at a time, twice
        ([60, 3, 99, 18], (9, 3), 64, 16),  # SmolLM2's heads: GQA 3, below the 4-head tile
        ([20, 66], (10, 2), 64, 16),  # GQA 5: one 4-head tile and one head left
    ],
)
def test_decode_kernel_matches_reference(seq_lens, heads, head_dim, block_size):
    got, expected = run_both(*decode_batch(seq_lens, heads, head_dim, block_size, torch.float32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_decode_kernel_sliding_window_sees_only_the_window():
    batch = decode_batch([5, 40, 70], (8, 2), 32, 8, torch.float32, seed=1)
    got, expected = run_both(*batch, window=9)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    unwindowed, _ = run_both(*batch, window=None)
    # Only the request shorter than the window attends to the same keys either way.
    torch.testing.assert_close(got[0], unwindowed[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[1:], unwindowed[1:], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_kernel_half_precision_accumulates_in_float(dtype):
    q, k, v, layer, metadata = decode_batch([9, 77, 130], (8, 4), 64, 16, dtype, seed=2)
    got, _ = run_both(q, k, v, layer, metadata)
    # The float32 reference over the same (rounded) inputs.
    _, expected = run_both(q.float(), k.float(), v.float(), layer.float(), metadata)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_decode_kernel_refuses_mismatched_inputs():
    q, _, _, layer, metadata = decode_batch([4, 8], (8, 4), 32, 4, torch.float32)
    kernel = cpu_attention.load_kernel()
    out = torch.empty_like(q)
    lens = metadata.decode_seq_lens
    six_heads = q[:, :6].contiguous()
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        kernel.paged_decode_attention(
            torch.empty_like(six_heads), six_heads, layer, metadata.block_table, lens, 0, 1.0
        )
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.paged_decode_attention(out, q.double(), layer, metadata.block_table, lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.paged_decode_attention(out, q, layer, metadata.block_table.int(), lens, 0, 1.0)


def test_auto_picks_the_kernel_on_cpu():
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), cpu_attention.CpuBackend)
    assert type(get_attention_backend("torch", torch.device("cpu"))) is TorchReferenceBackend


def test_auto_falls_back_to_reference_when_the_kernel_cannot_build(monkeypatch, caplog):
    def fail():
        raise cpu_attention.KernelBuildError("cannot build the CPU attention kernel: no compiler")

    monkeypatch.setattr(cpu_attention, "load_kernel", fail)
    with caplog.at_level(logging.WARNING):
        backend = get_attention_backend("auto", torch.device("cpu"))
    assert type(backend) is TorchReferenceBackend
    assert "no compiler" in caplog.text
    with pytest.raises(ValueError, match="no compiler"):
        get_attention_backend("cpu", torch.device("cpu"))


def test_cpu_backend_needs_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CPU device"):
        get_attention_backend("cpu", torch.device("meta"))


def test_mixed_step_with_strided_queries_matches_reference():
    """Decode, prefill chunk, decode in one step, q and k as views into one qk tensor (as the
    model passes them): the kernel path gathers the decode queries and writes them back."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block_size = 8, 2, 32, 4
    cache = torch.randn(40, 2, 2, block_size, kv_heads, dim, generator=gen)[:, 0]
    table = torch.tensor([[3, 7, 0], [12, 5, 9], [20, 21, 22]])
    # Row 0 decodes at position 6, row 1 prefills positions 5..7 (5 cached), row 2 decodes at 9.
    positions = torch.tensor([6, 5, 6, 7, 9])
    rows = torch.tensor([0, 1, 1, 1, 2])
    metadata = AttentionMetadata(
        num_tokens=5,
        block_size=block_size,
        slot_block=table[rows, positions // block_size],
        slot_offset=positions % block_size,
        block_table=table,
        decode_token_indices=torch.tensor([0, 4]),
        decode_block_table=table[[0, 2]].contiguous(),
        decode_seq_lens=torch.tensor([7, 10]),
        prefills=[PrefillSlice(row=1, query_start=1, query_len=3, seq_len=8)],
    )
    qk = torch.randn(5, heads + kv_heads, dim, generator=gen)
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn(5, kv_heads, dim, generator=gen)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    expected = TorchReferenceBackend().forward(q, k, v, ref_cache, metadata, 0.2)
    got = cpu_attention.CpuBackend().forward(q, k, v, cpu_cache, metadata, 0.2)
    assert torch.equal(cpu_cache, ref_cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_write_kv_refuses_a_slot_outside_the_cache():
    q, k, v, layer, metadata = decode_batch([4, 8], (8, 4), 32, 4, torch.float32)
    kernel = cpu_attention.load_kernel()
    bad_block = metadata.slot_block.clone()
    bad_block[1] = layer.shape[0]
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.write_kv(layer, k, v, bad_block, metadata.slot_offset)


@pytest.mark.timeout(120)
def test_a_stale_torch_build_lock_does_not_hang_the_load():
    """A process killed mid-build leaves torch's lock file behind; loading must not wait on it."""
    (cpu_attention.build_directory() / "lock").write_text("")
    cpu_kernels.load.cache_clear()
    try:
        kernel = cpu_attention.load_kernel()
    finally:
        cpu_kernels.load.cache_clear()
    assert hasattr(kernel, "paged_decode_attention")
    assert not (cpu_attention.build_directory() / "lock").exists()
