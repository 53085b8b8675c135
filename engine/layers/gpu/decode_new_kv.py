"""A decode-only step's own K and V inside the decode kernel (attention_kernels.py): q and k
rotated there, K/V written into their cache slot by one program and used by every program
from registers, so the step needs no separate write launch per layer.

The rotation is fused_ops.rotate's, the same FMA as rotary_kv_write's: a token's K comes out
bit for bit the same whichever kernel wrote it (a step with prefills uses the separate one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.layers.gpu import fused_ops


@dataclass(frozen=True)
class NewTokenKV:
    """A decode-only step's own K and V, for decode_attention to write into the cache and to
    attend with: the step then needs no separate KV-write launch (one per layer). With cos
    and sin (the step's RopeTables rows, [T, D]), q and k come before rotation."""

    k: torch.Tensor  # [T, Hkv, D], dense heads
    v: torch.Tensor
    slot_block: torch.Tensor  # [T] int64
    slot_offset: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def launch_args(self) -> tuple[list[torch.Tensor], list[int]]:
        """(pointers, strides) in the order _decode_kernel takes them."""
        cos = self.cos if self.cos is not None else self.k
        sin = self.sin if self.sin is not None else self.k
        pointers = [self.k, self.v, cos, sin, self.slot_block, self.slot_offset]
        strides = [*self.k.stride()[:2], *self.v.stride()[:2], cos.stride(0)]
        return pointers, strides


@triton.jit
def _rotated(  # type: ignore[no-untyped-def]
    rows, d, mask, cos, sin, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr
):
    """Rows at `rows` (a pointer, or a column of them) "rotated half" by cos/sin [DIM_PAD] in
    float32 with fused_ops.rotate, as rotary_kv_write rotates them (bit for bit the same
    values); or, with ROTATE off, as they are."""
    half = HEAD_DIM // 2
    x = tl.load(rows + d, mask=mask, other=0.0).to(tl.float32)
    if not ROTATE:
        return x
    partner = tl.load(rows + tl.where(d < half, d + half, d - half), mask=mask, other=0.0)
    partner = partner.to(tl.float32)
    return fused_ops.rotate(x, tl.where(d < half, -partner, partner), cos, sin)


# fmt: off
@triton.jit
def new_token(  # type: ignore[no-untyped-def]
    q_rows, rows_ok, k_row, v_row, cos_ptr, sin_ptr, rope_row,
    head_ptr,  # the cache layer at this KV head
    slot_block_ptr, slot_offset_ptr,  # the token's slot
    block_stride, slot_stride, kv_stride, seq_len, lo, hi, d, q_ptr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, ROTATE: tl.constexpr,
):
    # fmt: on
    """A decode's q and its own K and V (rotated with ROTATE); K/V written into the token's
    slot by the one program whose split, tiles [lo, hi), holds the token's position."""
    d_ok = d < HEAD_DIM
    # Each half's angles from the table's first half, as rotary_kv_write reads them.
    rope = rope_row + d % (HEAD_DIM // 2)
    cos = tl.load(cos_ptr + rope, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + rope, mask=d_ok, other=0.0).to(tl.float32)
    q = _rotated(q_rows, d, rows_ok, cos, sin, HEAD_DIM, ROTATE).to(q_ptr.dtype.element_ty)
    cache_ty = head_ptr.dtype.element_ty
    new_k = _rotated(k_row, d, d_ok, cos, sin, HEAD_DIM, ROTATE).to(cache_ty)
    new_v = tl.load(v_row + d, mask=d_ok, other=0.0).to(cache_ty)
    slot = tl.load(slot_block_ptr) * block_stride + tl.load(slot_offset_ptr) * slot_stride
    # The tile of the token's position, as a vector: Triton's interpreter cannot combine a
    # scalar condition with a vector mask.
    last = tl.full([DIM_PAD], 0, tl.int32) + (seq_len - 1) // BLOCK_N
    writes = d_ok & (lo <= last) & (last < hi)
    tl.store(head_ptr + slot + d, new_k, mask=writes)
    tl.store(head_ptr + slot + kv_stride + d, new_v, mask=writes)
    return q, new_k, new_v
