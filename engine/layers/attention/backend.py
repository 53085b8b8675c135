"""The attention backend contract and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class PrefillSlice:
    """One request with several query tokens this step (a prompt or a chunk of it)."""

    row: int  # index into the step's block table
    query_start: int  # first of its tokens in the flattened step input
    query_len: int
    seq_len: int  # context length once this step's tokens are in


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; shared by every layer.

    Token-level: `slot_block` / `slot_offset` say where each new token's K/V goes.
    Request-level: decodes (one query token each) are batched; prefills go one by one.
    """

    num_tokens: int
    slot_block: torch.Tensor  # [T] int64: physical block of each new token
    slot_offset: torch.Tensor  # [T] int64: offset inside that block
    block_table: torch.Tensor  # [R, max_blocks] int64 (rows of the scheduled requests)
    # Batched decodes: each reads the slots of its context, padded to the longest one.
    decode_token_indices: torch.Tensor  # [Bd] int64 positions in the flattened input
    decode_slot_block: torch.Tensor  # [Bd, S] int64 block of each context position
    decode_slot_offset: torch.Tensor  # [Bd, S] int64 offset inside it
    decode_mask: torch.Tensor  # [Bd, S] bool: visible (inside the context and the window)
    prefills: list[PrefillSlice]
    sliding_window: int | None = None

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_indices.shape[0])


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends over the whole context.

    `kv_cache` is one layer's view of the block-contiguous cache: [num_blocks, 2, block_size,
    num_kv_heads, head_dim] (index 0 = K, 1 = V). Prefills and decodes of one step come
    together; the causal mask is aligned bottom-right, so a chunk or a request with prefix hits
    sees its whole cached context.
    """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...
