"""The per-layer elementwise work of a decoder layer as single Triton kernels.

Each replaces several small torch kernels whose launches, not their bytes, dominate a GPU
decode step of a small model (SmolLM2's step was ~31 launches per layer):
- rotary_kv_write: rotate q and k ("rotate half", HF Llama) and write k and v into their KV
  cache slots — one kernel for what was a table lookup, six elementwise ops and two scatters;
- add_rms_norm: the residual add and the RMSNorm that follows it, in one pass over the row;
- silu_mul: SiLU(gate) * up from the stacked gate/up projection.

Numerics follow the torch modules they replace (engine/layers/norm.py, rotary.py): float32
statistics, a half-precision normalised value rounded to its dtype before the weight (HF's
order), the residual sum rounded to the stream's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotate(x, partner, cos, sin):  # type: ignore[no-untyped-def]
    """x cos + partner sin (partner: -x2 for the first half, x1 for the second) as one
    explicit FMA over the rounded partner * sin: every kernel that rotates gets the same bits,
    whichever products the compiler would otherwise have contracted (on the GPU it did, two
    kernels' a*b - c*d differently)."""
    return tl.fma(x, cos, partner * sin)


@triton.jit
def _rotate_half_rows(  # type: ignore[no-untyped-def]
    x_ptr,
    tok_stride,
    head_stride,
    token,
    cos,
    sin,
    heads,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Heads [HEADS_PAD] of one token, rotated: (x1 cos - x2 sin, x2 cos + x1 sin) per half,
    in float32, with the mask of the valid entries."""
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (h < heads)[:, None] & (j < HALF)[None, :]
    row = x_ptr + token * tok_stride + h[:, None] * head_stride
    x1 = tl.load(row + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
    return rotate(x1, -x2, cos, sin), rotate(x2, x1, cos, sin), mask


# fmt: off
@triton.jit
def _rotary_kv_write_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr,  # [T, H, D] each, any token and head strides
    cos_ptr, sin_ptr,  # [T, D] rows of this step's positions (the two halves equal)
    q_out_ptr,  # [T, Hq, D] contiguous
    cache_ptr,  # one layer: [num_blocks, 2, block_size, Hkv, D]
    slot_block_ptr, slot_offset_ptr,  # [T] int64 each
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, v_tok_stride, v_head_stride,
    rope_stride, block_stride, kv_stride, slot_stride, head_stride, num_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, ROTATE: tl.constexpr,
):
    # fmt: on
    token = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements in long steps
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    kh = tl.arange(0, KV_HEADS_PAD)
    if ROTATE:
        rope = token * rope_stride + j
        cos = tl.load(cos_ptr + rope, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + rope, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        q1, q2, q_mask = _rotate_half_rows(
            q_ptr, q_tok_stride, q_head_stride, token, cos, sin, num_heads,
            HEADS_PAD, HALF, HALF_PAD,
        )  # fmt: skip
        h = tl.arange(0, HEADS_PAD)
        q_row = q_out_ptr + token * num_heads * 2 * HALF + h[:, None] * 2 * HALF + j[None, :]
        dtype = q_out_ptr.dtype.element_ty
        tl.store(q_row, q1.to(dtype), mask=q_mask)
        tl.store(q_row + HALF, q2.to(dtype), mask=q_mask)
        k1, k2, kv_mask = _rotate_half_rows(
            k_ptr, k_tok_stride, k_head_stride, token, cos, sin, num_kv_heads,
            KV_HEADS_PAD, HALF, HALF_PAD,
        )  # fmt: skip
    else:  # k was rotated already: written as it is
        kv_mask = (kh < num_kv_heads)[:, None] & j_ok[None, :]
        k_row = k_ptr + token * k_tok_stride + kh[:, None] * k_head_stride + j[None, :]
        k1 = tl.load(k_row, mask=kv_mask, other=0.0)
        k2 = tl.load(k_row + HALF, mask=kv_mask, other=0.0)
    block = tl.load(slot_block_ptr + token)
    offset = tl.load(slot_offset_ptr + token)
    slot = cache_ptr + block * block_stride + offset * slot_stride
    k_slot = slot + kh[:, None] * head_stride + j[None, :]
    cache_dtype = cache_ptr.dtype.element_ty
    tl.store(k_slot, k1.to(cache_dtype), mask=kv_mask)
    tl.store(k_slot + HALF, k2.to(cache_dtype), mask=kv_mask)
    v_row = v_ptr + token * v_tok_stride + kh[:, None] * v_head_stride + j[None, :]
    tl.store(k_slot + kv_stride, tl.load(v_row, mask=kv_mask, other=0.0), mask=kv_mask)
    tl.store(
        k_slot + kv_stride + HALF, tl.load(v_row + HALF, mask=kv_mask, other=0.0), mask=kv_mask
    )


def rope_rows(table: torch.Tensor) -> torch.Tensor:
    """RopeTables' [T, 1, D] as [T, D] rows."""
    return table.reshape(table.shape[0], table.shape[-1])


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
) -> torch.Tensor:
    """Rotate q [T, Hq, D] (returned, contiguous) and k [T, Hkv, D], and write k and v into
    `kv_cache` (one layer, [num_blocks, 2, block_size, Hkv, D]) at each token's slot.
    cos/sin: the step's RopeTables ([T, 1, D])."""
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    cos_rows, sin_rows = rope_rows(cos), rope_rows(sin)
    _launch_kv_write(q, q_out, k, v, cos_rows, sin_rows, kv_cache, slot_block, slot_offset)
    return q_out


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
) -> None:
    """Write k (rotated already) and v into their slots: the same kernel, rotating nothing (k
    stands in for the pointers it does not read)."""
    _launch_kv_write(None, k, k, v, k, k, kv_cache, slot_block, slot_offset)


def _launch_kv_write(
    q: torch.Tensor | None,
    q_out: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_rows: torch.Tensor,
    sin_rows: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if head_dim % 2 or k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("rotary_kv_write needs an even head_dim and dense heads")
    num_heads = q.shape[1] if q is not None else 0
    q_in = q if q is not None else k
    half = head_dim // 2
    _rotary_kv_write_kernel[(num_tokens,)](
        q_in, k, v, cos_rows, sin_rows, q_out, kv_cache, slot_block, slot_offset,
        q_in.stride(0), q_in.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_rows.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), num_heads, num_kv_heads,
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(max(num_heads, 1)),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), ROTATE=q is not None,
    )  # fmt: skip


@triton.jit
def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    n_cols,
    x_stride,
    residual_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements in long steps
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # Summed in float32 and rounded to the stream's dtype: torch's add, bit for bit.
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    normed = xf * tl.rsqrt(variance + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HALF:  # HF: the normalised value in x's dtype, then the weight
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    out = (normed * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) over rows of x [T, H]; with no residual,
    (RMSNorm(x), x)."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("add_rms_norm needs dense rows")
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed, cols, x.stride(0),
        residual.stride(0) if residual is not None else 0, eps,
        HAS_RESIDUAL=residual is not None, HALF=x.dtype != torch.float32,
        BLOCK=triton.next_power_of_2(cols),
    )  # fmt: skip
    return out, summed


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    gate_up_ptr, out_ptr, inner, row_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements in long steps
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(gate_up_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * row_stride + inner + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # torch rounds SiLU's result to the dtype before the product; so does this.
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * inner + cols, out, mask=mask)


_SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2 * inner] (gate first, as StackedLinear stacks them)."""
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_mul needs dense rows")
    rows, width = gate_up.shape
    inner = width // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    block = min(_SILU_BLOCK, triton.next_power_of_2(inner))
    grid = (rows, triton.cdiv(inner, block))
    _silu_mul_kernel[grid](gate_up, out, inner, gate_up.stride(0), BLOCK=block)
    return out
