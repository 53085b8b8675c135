"""Reference attention over the paged KV cache in plain torch: any device, the test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillSlice


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
) -> None:
    """Scatter this step's K/V into their slots (before any read: a request that hit a block
    computed earlier in this same step reads it here)."""
    kv_cache[metadata.slot_block, 0, metadata.slot_offset] = k
    kv_cache[metadata.slot_block, 1, metadata.slot_offset] = v


def gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks: [..., n_blocks] ids -> [..., n_blocks * block_size, Hkv, D]."""
    blocks = kv_cache[block_ids]  # [..., n, 2, bs, Hkv, D]
    shape = (*block_ids.shape[:-1], -1, *blocks.shape[-2:])
    return blocks[..., 0, :, :, :].reshape(shape), blocks[..., 1, :, :, :].reshape(shape)


def gather_slots(
    kv_cache: torch.Tensor, slot_block: torch.Tensor, slot_offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given slots ([B, S] blocks and offsets) as [B, S, Hkv, D] each.

    One `index_select` over the cache seen as rows of one slot's values is several times
    faster than advanced indexing. The rows of this layer follow from the view's strides, so
    any layout in which a slot's (Hkv, D) values are contiguous works — a tensor-parallel
    rank's view of its heads of a cache of every head too (a slot's row is then every head,
    of which this view's are a contiguous part).
    """
    heads, dim = kv_cache.shape[-2:]
    token = kv_cache.stride(2)  # elements from a slot's values to the next slot's
    storage_rows = kv_cache.untyped_storage().nbytes() // (kv_cache.element_size() * token)
    flat = kv_cache.as_strided((storage_rows, token), (token, 1), 0)
    first_row, head_offset = divmod(int(kv_cache.storage_offset()), token)
    block_stride, kv_stride = kv_cache.stride(0) // token, kv_cache.stride(1) // token
    rows = (slot_block * block_stride + slot_offset + first_row).reshape(-1)
    shape = (*slot_block.shape, heads, dim)
    columns = slice(head_offset, head_offset + heads * dim)
    keys = flat.index_select(0, rows)[:, columns].reshape(shape)
    values = flat.index_select(0, rows + kv_stride)[:, columns].reshape(shape)
    return keys, values


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility, [..., q, k]: key j is seen by the query at
    absolute position p when j <= p and, with a window W, p - j < W."""
    mask = key_pos <= query_pos
    if window is not None:
        mask &= query_pos - key_pos < window
    return mask


class TorchReferenceBackend(AttentionBackend):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._write_kv(kv_cache, k, v, metadata)
        out = torch.empty_like(q)
        if metadata.num_decodes:
            self._decodes(q, kv_cache, metadata, scale, out)
        if metadata.prefills:
            self._prefills(q, k, v, kv_cache, metadata, scale, out)
        return out

    def _write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> None:
        write_kv(kv_cache, k, v, md)

    def _prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One request at a time: on a CPU the loop costs less than padding."""
        for prefill in md.prefills:
            self._prefill(q, k, v, kv_cache, md, prefill, scale, out)

    def _decodes(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        slot_block, slot_offset, visible = md.decode_slots
        keys, values = gather_slots(kv_cache, slot_block, slot_offset)
        queries = q[md.decode_token_indices].unsqueeze(2)  # [Bd, Hq, 1, D]
        attended = F.scaled_dot_product_attention(
            queries,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=visible[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[md.decode_token_indices] = attended.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        p: PrefillSlice,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        end = p.query_start + p.query_len
        if p.seq_len == p.query_len:
            # A whole prompt with nothing cached: its context is exactly this step's K/V.
            keys, values = k[p.query_start : end], v[p.query_start : end]
        else:
            block_size = kv_cache.shape[2]
            num_blocks = -(-p.seq_len // block_size)
            keys, values = gather_context(kv_cache, md.block_table[p.row, :num_blocks])
            keys, values = keys[: p.seq_len], values[: p.seq_len]  # [S, Hkv, D]
        mask = None
        if p.seq_len != p.query_len or md.sliding_window is not None:
            # Bottom-right alignment: the last query token sits at position seq_len - 1.
            first = p.seq_len - p.query_len
            query_pos = torch.arange(first, p.seq_len, device=q.device).unsqueeze(1)
            key_pos = torch.arange(p.seq_len, device=q.device).unsqueeze(0)
            mask = _visible(query_pos, key_pos, md.sliding_window)
        queries = q[p.query_start : p.query_start + p.query_len].transpose(0, 1)  # [Hq, Q, D]
        attended = F.scaled_dot_product_attention(
            queries.unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            # A whole prompt: plain causal (top-left = bottom-right), SDPA skips masked tiles.
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[p.query_start : p.query_start + p.query_len] = attended[0].transpose(0, 1)
