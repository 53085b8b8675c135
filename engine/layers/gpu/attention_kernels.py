"""Paged attention in Triton: decode and prefill read K/V blocks where they lie in the cache.

The cache is one layer's view, [num_blocks, 2, block_size, Hkv, D] (engine/worker/kv_cache.py);
the kernels follow its strides, so a tensor-parallel rank's view of its heads works too. A
tile of BLOCK_N context positions may span several KV blocks (any block size): each position
looks up its own block in the table, so no context is ever gathered into a padded copy.

- Decode (one query token per sequence): a program per (sequence, KV head, split) computes
  every query head of that KV head's group at once (GQA: K/V are read once per group), over
  its split of the context, with an online softmax. Long contexts are split along the
  sequence so that a small batch still fills the GPU; a second kernel merges the splits by
  their log-sum-exp. One split writes the output directly. In a decode-only step the kernel
  also rotates q and k and writes the step's own K/V into the cache (NewTokenKV), using them
  from registers: a CUDA graph's step needs no separate write launch per layer.
- Prefill (several query tokens: prompts, chunks, requests with cached prefixes): a program
  per (request, tile of BLOCK_M queries, query head), causal aligned bottom-right, so a chunk
  sees its whole cached context; keys before a sliding window are skipped a tile at a time.

Numerics: float32 caches multiply in IEEE float32 (never tf32: float32 is the parity
oracle); half-precision caches use the tensor cores with float32 accumulation, probabilities
rounded to the cache's dtype before P·V as flash attention does. Under Triton's interpreter
(TRITON_INTERPRET=1, how the tests run these on CPUs) half-precision dots are computed on
float32 copies: its dot multiplies bfloat16's raw bits (Triton 3.9). A bf16 x bf16 product is
exact in float32, so only the summation order differs from the tensor cores'. (The interpreter
also truncates when it converts to bfloat16, where GPUs round to nearest: half-precision
results there are close, not equal, to a GPU's.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.gpu import interpreted
from engine.layers.gpu.decode_new_kv import NewTokenKV, new_token

# Context positions per decode tile: 128 for heads of up to 64 (SmolLM2's), 64 for 128. A
# single stream's program walks its tiles one after the other, each a table lookup and then
# dependent loads, so fewer, wider tiles cut its latency; K and V of a tile stay in registers.
_DECODE_TILE_ELEMENTS = 8192
# A split covers at least this many tiles: fewer makes the merge cost more than it spreads.
_MIN_TILES_PER_SPLIT = 4
MAX_DECODE_SPLITS = 16


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):  # type: ignore[no-untyped-def]
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tiles(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    q,  # [ROWS, DIM_PAD]: query rows of one KV head
    query_pos,  # [ROWS] int32: each row's position (a decode's: its context's last)
    seq_len,  # int32: the context's length (positions at or past it are not read)
    lo,  # first tile of positions to attend over
    hi,  # one past the last
    kv_head_base,  # the cache layer's first element of this KV head
    table_row,  # this sequence's row of the block table
    block_size,
    block_stride,
    kv_stride,
    slot_stride,
    scale,
    window,
    new_k,  # [DIM_PAD] with NEW_KV: the K and V of position seq_len - 1, used instead of
    new_v,  # the cache's (which this very program may be writing them into)
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    NEW_KV: tl.constexpr,
):
    """Online softmax of each row over the visible positions of tiles [lo, hi): (running max,
    sum of exponentials, unnormalised output) in float32. Visible: causal (position <= the
    row's), inside the context, and with a window W, less than W behind the row."""
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    for tile in range(lo, hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_context = pos < seq_len
        block = tl.load(table_row + pos // block_size, mask=in_context, other=0)
        slot = block * block_stride + (pos % block_size) * slot_stride
        kv_mask = in_context[:, None] & d_ok[None, :]
        k = tl.load(kv_head_base + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v_ptrs = kv_head_base + kv_stride + slot[:, None] + d[None, :]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if NEW_KV:
            is_new = (pos == seq_len - 1)[:, None]
            k = tl.where(is_new, new_k[None, :], k)
            v = tl.where(is_new, new_v[None, :], v)
        visible = (pos[None, :] <= query_pos[:, None]) & in_context[None, :]
        if WINDOWED:
            visible = visible & (query_pos[:, None] - pos[None, :] < window)
        s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale  # [ROWS, BLOCK_N]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row may see nothing in a tile yet (windows, padding rows): it stays at zero.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m = m_new
    return m, l_sum, acc


# fmt: off
@triton.jit
def _decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, tokens_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,  # the splits' (max, sum, output): [B, Hq, SPLITS(, D)]
    k_ptr, v_ptr, cos_ptr, sin_ptr, slot_block_ptr, slot_offset_ptr,  # NEW_KV: NewTokenKV's
    q_tok_stride, q_head_stride, out_tok_stride, out_head_stride, table_stride,
    block_stride, kv_stride, slot_stride, head_stride,
    k_tok_stride, k_head_stride, v_tok_stride, v_head_stride, rope_stride,
    scale, window, block_size, tiles_per_split, num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    WINDOWED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    NEW_KV: tl.constexpr, ROTATE: tl.constexpr,
):
    # fmt: on
    """One (sequence, KV head, split): every query head of the group over the split's tiles
    of the context (the sequence's query row tokens_ptr[b] of q; seq_lens_ptr[b] positions).
    With NEW_KV, the token's own K/V are not in the cache yet (decode_new_kv.py)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Positions in int32 (loop bounds of one type); offsets into memory stay int64.
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    token = tl.load(tokens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    rows_ok = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + g
    q_rows = q_ptr + token * q_tok_stride + heads[:, None] * q_head_stride
    first = 0
    if WINDOWED:  # positions seq_len - window .. seq_len - 1
        first = tl.maximum(seq_len - window, 0)
    lo = tl.maximum(split * tiles_per_split, first // BLOCK_N)
    hi = tl.minimum((split + 1) * tiles_per_split, tl.cdiv(seq_len, BLOCK_N))
    new_k, new_v = 0.0, 0.0
    if NEW_KV:
        q, new_k, new_v = new_token(
            q_rows, rows_ok, k_ptr + token * k_tok_stride + kv_head * k_head_stride,
            v_ptr + token * v_tok_stride + kv_head * v_head_stride, cos_ptr, sin_ptr,
            token * rope_stride, cache_ptr + kv_head * head_stride, slot_block_ptr + token,
            slot_offset_ptr + token, block_stride, slot_stride, kv_stride, seq_len, lo, hi, d,
            q_ptr, HEAD_DIM, DIM_PAD, BLOCK_N, ROTATE,
        )  # fmt: skip
    else:
        q = tl.load(q_rows + d[None, :], mask=rows_ok, other=0.0)
    query_pos = tl.full([GROUP_PAD], 0, tl.int32) + seq_len - 1
    m, l_sum, acc = _attend_tiles(
        q, query_pos, seq_len, lo, hi, cache_ptr + kv_head * head_stride,
        table_ptr + row * table_stride, block_size, block_stride, kv_stride, slot_stride,
        scale, window, new_k, new_v, GROUP_PAD, HEAD_DIM, DIM_PAD, BLOCK_N, WINDOWED, IEEE,
        UPCAST, NEW_KV,
    )  # fmt: skip
    if SPLITS == 1:
        out_rows = out_ptr + token * out_tok_stride + heads[:, None] * out_head_stride
        out = (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_rows + d[None, :], out, mask=rows_ok)
    else:  # an empty split stores (-inf, 0, 0): the merge weighs it at nothing
        part = (row * num_heads + heads) * SPLITS + split  # [GROUP_PAD]
        _store_split(part_m_ptr, part_l_ptr, part_acc_ptr, part, m, l_sum, acc, g < GROUP, d,
                     DIM_PAD)  # fmt: skip


@triton.jit
def _store_split(  # type: ignore[no-untyped-def]
    part_m_ptr, part_l_ptr, part_acc_ptr, part, m, l_sum, acc, rows, d, DIM_PAD: tl.constexpr
):
    """One split's (max, sum, unnormalised output) of each row, for the merge."""
    tl.store(part_m_ptr + part, m, mask=rows)
    tl.store(part_l_ptr + part, l_sum, mask=rows)
    tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=rows[:, None])


# fmt: off
@triton.jit
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    part_m_ptr, part_l_ptr, part_acc_ptr, tokens_ptr, out_ptr,
    out_tok_stride, out_head_stride, num_heads,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # fmt: on
    """out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M the largest m_s (an empty
    split has m = -inf and weighs nothing)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_ok = s < SPLITS
    base = (row * num_heads + head) * SPLITS
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    acc_ptrs = part_acc_ptr + (base + s)[:, None] * DIM_PAD + d[None, :]
    acc = tl.load(acc_ptrs, mask=s_ok[:, None], other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))
    weight = tl.where(s_ok, weight, 0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_sum * weight, axis=0)
    token = tl.load(tokens_ptr + row)
    out_row = out_ptr + token * out_tok_stride + head * out_head_stride
    tl.store(out_row + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# fmt: off
@triton.jit
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr, cache_ptr, table_ptr, out_ptr,
    starts_ptr, q_lens_ptr, seq_lens_ptr, rows_ptr,  # [P] each (AttentionMetadata.prefill_tensors)
    q_tok_stride, q_head_stride, out_tok_stride, out_head_stride, table_stride,
    block_stride, kv_stride, slot_stride, head_stride,
    scale, window, block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    # fmt: on
    """One (prefill, tile of BLOCK_M queries, query head): causal aligned bottom-right, so
    a chunk or a request with prefix hits sees its whole cached context."""
    prefill = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + prefill).to(tl.int32)
    start = tl.load(starts_ptr + prefill)
    seq_len = tl.load(seq_lens_ptr + prefill).to(tl.int32)
    i = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    rows_ok = (i < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    query_pos = seq_len - q_len + i  # the last query sits at position seq_len - 1
    q_rows = q_ptr + (start + i)[:, None] * q_tok_stride + head * q_head_stride
    q = tl.load(q_rows + d[None, :], mask=rows_ok, other=0.0)
    lowest = seq_len - q_len + q_tile * BLOCK_M
    lo = 0
    if WINDOWED:  # keys before the lowest query's window are skipped a tile at a time
        lo = tl.maximum(lowest - window + 1, 0) // BLOCK_N
    hi = tl.cdiv(tl.minimum(lowest + BLOCK_M, seq_len), BLOCK_N)
    # The grid is sized for the step's longest prefill: a tile past this one's end does nothing.
    hi = tl.where(q_tile * BLOCK_M < q_len, hi, lo)
    _max, l_sum, acc = _attend_tiles(
        q, query_pos, seq_len, lo, hi, cache_ptr + (head // GROUP) * head_stride,
        table_ptr + tl.load(rows_ptr + prefill) * table_stride, block_size, block_stride,
        kv_stride, slot_stride, scale, window, 0.0, 0.0, BLOCK_M, HEAD_DIM, DIM_PAD, BLOCK_N,
        WINDOWED, IEEE, UPCAST, False,
    )  # fmt: skip
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    out_rows = out_ptr + (start + i)[:, None] * out_tok_stride + head * out_head_stride
    tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=rows_ok)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_cache.dim() != 5 or kv_cache.stride(4) != 1:
        raise ValueError("the KV cache layer must be [num_blocks, 2, block_size, Hkv, D], D dense")
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _dot_modes(dtype: torch.dtype) -> tuple[bool, bool]:
    """(IEEE, UPCAST) for a cache of `dtype` (the module docstring says why)."""
    half = dtype != torch.float32
    return not half or interpreted(), half and interpreted()


def decode_block_n(head_dim: int) -> int:
    """Positions per decode tile (32 to 128): head_dim 64 -> 128, 128 -> 64."""
    return max(32, min(128, _DECODE_TILE_ELEMENTS // _pow2(head_dim, 16)))


def decode_splits(
    batch: int, kv_heads: int, context_len: int, multiprocessors: int, block_n: int
) -> int:
    """Splits of the context per (sequence, KV head): enough programs for two per
    multiprocessor, each split at least _MIN_TILES_PER_SPLIT tiles, at most MAX_DECODE_SPLITS.

    # batch 1, 3 KV heads, 4,096 positions, 64-position tiles, 132 SMs
    #   -> min(88, 64 // 4 = 16, 16) = 16
    """
    tiles = triton.cdiv(max(context_len, 1), block_n)
    wanted = triton.cdiv(2 * multiprocessors, batch * kv_heads)
    return max(1, min(wanted, tiles // _MIN_TILES_PER_SPLIT, MAX_DECODE_SPLITS))


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    token_indices: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int | None,
    context_len: int,
    splits: int,
    new_kv: NewTokenKV | None = None,
) -> None:
    """out[token_indices[b]] = attention of q[token_indices[b]] over the first seq_lens[b]
    positions of row b of `block_table` (the last `window` of them with a sliding window).
    `context_len` bounds every seq_len (it sizes the splits: fixed per captured graph).
    With `new_kv`, each decode's own K/V (at token_indices[b]) are written here first, and q
    and k rotated here where it brings cos and sin."""
    batch = token_indices.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    block_n = decode_block_n(head_dim)
    tiles = triton.cdiv(max(context_len, 1), block_n)
    splits = max(1, min(splits, tiles))
    tiles_per_split = triton.cdiv(tiles, splits)
    dim_pad = _pow2(head_dim, 16)
    if splits > 1:
        part_m = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (batch, num_heads, splits, dim_pad), dtype=torch.float32, device=q.device
        )
    else:  # unused: the kernel writes the output itself
        part_m = part_l = part_acc = out
    ieee, upcast = _dot_modes(kv_cache.dtype)
    if new_kv is not None:
        if head_dim % 2 or new_kv.k.stride(2) != 1 or new_kv.v.stride(2) != 1:
            raise ValueError("decode_attention's new K/V need an even head_dim and dense heads")
        new_pointers, new_strides = new_kv.launch_args()
    else:
        new_pointers, new_strides = [q] * 6, [0] * 5
    _decode_kernel[(batch, kv_heads, splits)](
        q, kv_cache, block_table, seq_lens, token_indices, out, part_m, part_l, part_acc,
        *new_pointers,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        *_cache_strides(kv_cache), *new_strides, scale, window or 0, kv_cache.shape[2],
        tiles_per_split, num_heads,
        GROUP=group, GROUP_PAD=_pow2(group, 16), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_N=block_n, SPLITS=splits, WINDOWED=window is not None,
        IEEE=ieee, UPCAST=upcast, NEW_KV=new_kv is not None,
        ROTATE=new_kv is not None and new_kv.cos is not None,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_m, part_l, part_acc, token_indices, out, out.stride(0), out.stride(1),
            num_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS=splits,
            SPLITS_PAD=_pow2(splits),
        )  # fmt: skip


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    prefill_tensors: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None,
) -> None:
    """Attention of every prefill's queries over its context (its K/V already in the cache).
    `prefill_tensors` is int64 [4, P]: query start, query length, context length and table
    row of each prefill (AttentionMetadata.prefill_tensors)."""
    num_prefills = prefill_tensors.shape[1]
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // kv_cache.shape[3]
    half = kv_cache.dtype != torch.float32
    block_m = 64 if half and not interpreted() else 32
    starts, q_lens, seq_lens, rows = prefill_tensors
    ieee, upcast = _dot_modes(kv_cache.dtype)
    grid = (num_prefills, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q, kv_cache, block_table, out, starts, q_lens, seq_lens, rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        *_cache_strides(kv_cache), scale, window or 0, kv_cache.shape[2],
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=_pow2(head_dim, 16), BLOCK_M=block_m,
        BLOCK_N=32, WINDOWED=window is not None, IEEE=ieee, UPCAST=upcast,
    )  # fmt: skip
