"""The Triton kernels (engine/layers/gpu/) against the torch reference, on small shapes.

On this machine they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
for `--device cpu`); with `pytest --device cuda` the same tests run the compiled kernels on the
GPU. The reference is TorchReferenceBackend and the torch layer ops: the oracle of the suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.layers.attention import (
    AttentionMetadata,
    PrefillSlice,
    TorchReferenceBackend,
    get_attention_backend,
)
from engine.layers.attention.triton import TritonBackend
from engine.layers.gpu import attention_kernels, fused_ops
from engine.layers.layer_ops import TORCH_LAYER_OPS, TritonLayerOps
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeTables

# float32 is the parity dtype: the kernels sum in another order than SDPA, nothing more.
_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def device(pytestconfig) -> torch.device:
    return torch.device(pytestconfig.getoption("--device"))


@dataclass(frozen=True)
class Req:
    computed: int  # tokens whose K/V are in the cache already (a prefix hit, earlier chunks)
    new: int  # tokens this step computes
    decode: bool = False  # batched as a decode (one token attending token by token)


def mixed_step(reqs, heads, head_dim, block_size, dtype, device, seed=0):
    """A layer view of a 3-layer block-contiguous cache whose blocks are scattered, the cached
    context of every request filled in, and this step's q, k, v of every new token."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, kv_heads = heads
    seq_lens = [r.computed + r.new for r in reqs]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks) + 5
    cache = torch.randn(num_blocks, 3, 2, block_size, kv_heads, head_dim, generator=gen)
    layer = cache.to(dtype).to(device)[:, 1]
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(reqs), max(blocks), dtype=torch.int64)
    for row, count in enumerate(blocks):
        table[row, :count] = torch.tensor([ids.pop() for _ in range(count)])
    positions = [p for r in reqs for p in range(r.computed, r.computed + r.new)]
    rows = [i for i, r in enumerate(reqs) for _ in range(r.new)]
    pos, row_of = torch.tensor(positions), torch.tensor(rows)
    starts = torch.tensor([0, *[r.new for r in reqs]]).cumsum(0)[:-1].tolist()
    decodes = [i for i, r in enumerate(reqs) if r.decode]
    decode_tokens = [starts[i] + j for i in decodes for j in range(reqs[i].new)]
    prefills = [
        PrefillSlice(i, starts[i], r.new, seq_lens[i]) for i, r in enumerate(reqs) if not r.decode
    ]
    token_rows = row_of[decode_tokens]
    on = lambda t: t.to(device)  # noqa: E731
    metadata = AttentionMetadata(
        num_tokens=len(positions),
        block_size=block_size,
        slot_block=on(table[row_of, pos // block_size]),
        slot_offset=on(pos % block_size),
        block_table=on(table),
        decode_token_indices=on(torch.tensor(decode_tokens, dtype=torch.int64)),
        decode_block_table=on(table[token_rows]),
        decode_seq_lens=on(pos[decode_tokens] + 1),
        prefills=prefills,
        decode_max_seq_len=int(pos[decode_tokens].max()) + 1 if decode_tokens else 0,
    )
    shape = (len(positions), num_heads + 2 * kv_heads, head_dim)
    qkv = on(torch.randn(shape, generator=gen).to(dtype))
    q, k, v = qkv.split((num_heads, kv_heads, kv_heads), dim=1)
    return q, k, v, layer, metadata


def attend_both(q, k, v, layer, metadata, window=None, splits=None):
    """(triton's output, the reference's), after checking that both wrote the same cache."""
    metadata.sliding_window = window
    ref_cache, triton_cache = layer.clone(), layer.clone()
    expected = TorchReferenceBackend().forward(q, k, v, ref_cache, metadata, 0.3)
    backend = TritonBackend(q.device, decode_splits=splits)
    got = backend.forward(q, k, v, triton_cache, metadata, 0.3)
    assert torch.equal(triton_cache, ref_cache)  # the same K/V, bit for bit, in the same slots
    return got, expected


def assert_near(got, expected):
    tolerance = _TOLERANCE[expected.dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


DECODE_SHAPES = [
    ([1, 5, 17, 64, 33], (8, 4), 32, 16),  # GQA 2, lengths across block edges
    ([40], (4, 4), 64, 8),  # one sequence, no grouping
    ([3, 100, 7, 9, 250, 1], (12, 2), 128, 16),  # GQA 6, head_dim 128
    ([12, 13], (2, 1), 16, 4),  # MQA, a 32-position tile spans 8 blocks
    ([37, 70, 5], (6, 3), 40, 5),  # head_dim and block size not powers of two
    ([60, 3, 99], (9, 3), 64, 16),  # SmolLM2's heads: GQA 3
    ([500, 20, 260], (8, 2), 32, 16),  # 128-position tiles: 4 of them to split
]


@pytest.mark.parametrize(("seq_lens", "heads", "head_dim", "block_size"), DECODE_SHAPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(device, seq_lens, heads, head_dim, block_size, splits):
    reqs = [Req(n - 1, 1, decode=True) for n in seq_lens]
    step = mixed_step(reqs, heads, head_dim, block_size, torch.float32, device)
    assert_near(*attend_both(*step, splits=splits))


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sliding_window(device, window, splits):
    reqs = [Req(n - 1, 1, decode=True) for n in (3, 30, 300, 8)]  # 3 tiles of 128 for 300
    step = mixed_step(reqs, (6, 2), 32, 8, torch.float32, device, seed=1)
    assert_near(*attend_both(*step, window=window, splits=splits))


def test_decode_splits_beyond_the_context_weigh_nothing(device):
    """More splits than tiles of a short sequence: its empty splits merge as nothing."""
    reqs = [Req(2, 1, decode=True), Req(200, 1, decode=True)]
    step = mixed_step(reqs, (4, 2), 32, 16, torch.float32, device, seed=2)
    assert_near(*attend_both(*step, splits=8))


PREFILL_STEPS = {
    "whole prompts": [Req(0, 5), Req(0, 33), Req(0, 1)],
    "prefix hits": [Req(16, 9), Req(48, 40), Req(3, 2)],
    "chunks with decodes": [Req(0, 37), Req(9, 1, True), Req(64, 16), Req(70, 1, True)],
    "long chunk": [Req(20, 100)],
}


@pytest.mark.parametrize("reqs", PREFILL_STEPS.values(), ids=PREFILL_STEPS.keys())
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [((4, 2), 32, 4), ((9, 3), 64, 16)])
def test_prefill_and_mixed_steps_match_reference(device, reqs, heads, head_dim, block_size):
    step = mixed_step(reqs, heads, head_dim, block_size, torch.float32, device, seed=3)
    assert_near(*attend_both(*step))


@pytest.mark.parametrize("window", [1, 6, 50])
def test_prefill_sliding_window(device, window):
    reqs = [Req(0, 45), Req(30, 20), Req(7, 1, True), Req(60, 1, True)]
    step = mixed_step(reqs, (4, 1), 16, 4, torch.float32, device, seed=4)
    assert_near(*attend_both(*step, window=window))


def test_bfloat16_cache(device):
    """Half precision: probabilities in bf16 before P·V, float32 sums; close to the reference."""
    reqs = [Req(0, 21), Req(40, 1, True), Req(16, 7), Req(90, 1, True)]
    step = mixed_step(reqs, (8, 2), 64, 16, torch.bfloat16, device, seed=5)
    assert_near(*attend_both(*step, splits=2))


def test_split_count_follows_the_gpu():
    sms, splits = 132, attention_kernels.decode_splits
    assert attention_kernels.decode_block_n(64) == 128
    assert attention_kernels.decode_block_n(128) == 64
    assert attention_kernels.decode_block_n(256) == 32
    assert splits(1, 3, 8192, sms, 64) == attention_kernels.MAX_DECODE_SPLITS
    assert splits(32, 8, 8192, sms, 64) == 2  # 256 programs fill it already
    assert splits(1, 3, 128, sms, 64) == 1  # 2 tiles: nothing to split
    assert splits(64, 8, 100_000, sms, 64) == 1


def rope_tables(num_tokens, head_dim, dtype, device, seed=6):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=gen) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    return RopeTables(angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kv_write_matches_rotation_then_write(device, dtype):
    reqs = [Req(3, 4), Req(0, 9), Req(17, 1, True)]
    q, k, v, layer, md = mixed_step(reqs, (6, 2), 40, 4, dtype, device, seed=7)
    rope = rope_tables(q.shape[0], q.shape[2], dtype, device)
    ref_cache, triton_cache = layer.clone(), layer.clone()
    TorchReferenceBackend()._write_kv(ref_cache, rope.apply(k), v, md)
    rotated = fused_ops.rotary_kv_write(
        q, k, v, rope.cos, rope.sin, triton_cache, md.slot_block, md.slot_offset
    )
    assert rotated is not None and rotated.is_contiguous()
    assert_near(rotated, rope.apply(q))
    assert_near(triton_cache, ref_cache)
    written = triton_cache[md.slot_block, 1, md.slot_offset]
    assert torch.equal(written, v)  # values are copied, not rounded
    untouched = torch.ones_like(ref_cache, dtype=torch.bool)
    untouched[md.slot_block, :, md.slot_offset] = False
    assert torch.equal(triton_cache[untouched], layer[untouched])  # nothing else written


FUSED_DECODES = [
    ([1, 5, 17, 64, 33], (8, 4), 32, 16, 1, None),  # a 1-token context: only the new K/V
    ([60, 3, 99], (9, 3), 64, 16, 1, None),  # SmolLM2's heads
    ([500, 20, 260, 128], (8, 2), 32, 16, 3, None),  # the new position in the last split
    ([37, 70, 5], (6, 3), 40, 5, 2, 7),  # head_dim not a power of two, a window
]


@pytest.mark.parametrize("rotate", [False, True], ids=["written", "rotated"])
@pytest.mark.parametrize(("seq_lens", "heads", "head_dim", "block_size", "splits", "window"),
                         FUSED_DECODES)  # fmt: skip
def test_decode_only_step_writes_its_own_kv(
    device, monkeypatch, rotate, seq_lens, heads, head_dim, block_size, splits, window
):
    """A decode-only step (every CUDA graph's) in one launch per layer: the decode kernel
    rotates q and k and writes the step's K/V itself. Bit for bit what the separate write (and
    rotation) and then the decode kernel give: the same cache and the same output."""
    reqs = [Req(n - 1, 1, decode=True) for n in seq_lens]
    q, k, v, layer, md = mixed_step(reqs, heads, head_dim, block_size, torch.float32, device)
    md.sliding_window = window
    rope = rope_tables(q.shape[0], head_dim, torch.float32, device)
    separate_cache, fused_cache = layer.clone(), layer.clone()
    if rotate:
        rotated = fused_ops.rotary_kv_write(
            q, k, v, rope.cos, rope.sin, separate_cache, md.slot_block, md.slot_offset
        )
    else:
        fused_ops.kv_write(k, v, separate_cache, md.slot_block, md.slot_offset)
        rotated = q
    expected = torch.empty_like(rotated)
    attention_kernels.decode_attention(
        rotated, separate_cache, md.decode_block_table, md.decode_seq_lens,
        md.decode_token_indices, expected, 0.3, window, max(seq_lens), splits,
    )  # fmt: skip
    separate_writes = []
    for name in ("rotary_kv_write", "kv_write"):
        monkeypatch.setattr(fused_ops, name, lambda *a, _n=name: separate_writes.append(_n))
    backend = TritonBackend(device, decode_splits=splits)
    if rotate:
        got = backend.forward_rotary(q, k, v, rope, fused_cache, md, 0.3)
    else:
        got = backend.forward(q, k, v, fused_cache, md, 0.3)
    assert separate_writes == []  # the path claimed: no write of its own
    assert torch.equal(fused_cache, separate_cache)
    assert torch.equal(got, expected)


def test_decodes_reading_each_others_kv_are_written_first(device, monkeypatch):
    """A verification's tokens are batched as decodes, each attending over the ones before
    it: their K/V are written before any of them attends (the separate write), never by the
    decode kernel, whose programs run in no order."""
    reqs = [Req(20, 3, decode=True), Req(7, 1, decode=True), Req(40, 2, decode=True)]
    q, k, v, layer, md = mixed_step(reqs, (4, 2), 32, 4, torch.float32, device, seed=10)
    rope = rope_tables(q.shape[0], 32, torch.float32, device)
    separate = []
    original = fused_ops.rotary_kv_write
    monkeypatch.setattr(fused_ops, "rotary_kv_write", lambda *a: separate.append(1) or original(*a))
    ref_cache, triton_cache = layer.clone(), layer.clone()
    expected = TorchReferenceBackend().forward(rope.apply(q), rope.apply(k), v, ref_cache, md, 0.3)
    got = TritonBackend(device, decode_splits=2).forward_rotary(
        q, k, v, rope, triton_cache, md, 0.3
    )
    assert separate == [1]
    assert_near(triton_cache, ref_cache)
    assert_near(got, expected)


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(device, hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(8)
    norm = RMSNorm(hidden, 1e-5).to(dtype).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    rows = (torch.randn(5, 2 * hidden, generator=gen) * 3).to(dtype).to(device)
    x = rows[:, :hidden]  # a strided view, as a GEMM's output slice can be
    residual = torch.randn(5, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    got, got_sum = TritonLayerOps(device).add_rms_norm(x, residual, norm)
    expected, expected_sum = TORCH_LAYER_OPS.add_rms_norm(x, residual, norm)
    if dtype == torch.float32 or device.type == "cuda":
        assert torch.equal(got_sum, expected_sum)  # the residual stream: the same sums exactly
    else:  # Triton 3.9's interpreter truncates to bfloat16 (GPUs round to nearest, as torch)
        assert_near(got_sum, expected_sum)
    assert_near(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [48, 1536, 2500])
def test_silu_mul_matches_torch(device, dtype, inner):
    gen = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(3, 2 * inner, generator=gen) * 4).to(dtype).to(device)
    assert_near(TritonLayerOps(device).silu_mul(gate_up), TORCH_LAYER_OPS.silu_mul(gate_up))


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(get_attention_backend("triton", torch.device("cpu")), TritonBackend)
    assert not isinstance(get_attention_backend("auto", torch.device("cpu")), TritonBackend)
