"""The attention backend contract and the per-step metadata every backend reads."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.layers.layer_ops import TORCH_LAYER_OPS, LayerOps
from engine.layers.rotary import RopeTables


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
    block_size: int
    slot_block: torch.Tensor  # [T] int64: physical block of each new token
    slot_offset: torch.Tensor  # [T] int64: offset inside that block
    block_table: torch.Tensor  # [R, max_blocks] int64 (rows of the scheduled requests)
    # Batched decodes (one query token each, the last of its context).
    decode_token_indices: torch.Tensor  # [Bd] int64 positions in the flattened input
    decode_block_table: torch.Tensor  # [Bd, max_blocks] int64 (contiguous rows)
    decode_seq_lens: torch.Tensor  # [Bd] int64 context length, this step's token included
    prefills: list[PrefillSlice]
    sliding_window: int | None = None
    # Context positions each decode attends over (at least the longest context): fixed by a
    # captured CUDA graph, whose shapes cannot follow the step; None: the longest context.
    decode_context_len: int | None = None
    # The longest decode context, known on the host (0: not given; backends that need it
    # without a device sync take decode_context_len, else this).
    decode_max_seq_len: int = 0

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_indices.shape[0])

    @functools.cached_property
    def prefill_tensors(self) -> torch.Tensor:
        """int64 [4, P] on the step's device: query start, query length, context length and
        block-table row of each prefill (one copy per step, shared by every layer)."""
        columns = [(p.query_start, p.query_len, p.seq_len, p.row) for p in self.prefills]
        host = torch.tensor(columns, dtype=torch.int64).reshape(-1, 4).t().contiguous()
        return host.to(self.slot_block.device, non_blocking=True)

    @functools.cached_property
    def decode_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block, offset, visible) of every context position of each decode, [Bd, S] each,
        padded to the longest context (or `decode_context_len`); padding points at block 0
        (the null block), masked. Built on first use and shared by every layer of the step.

        # block_size 4, seq_lens [6, 3]  ->  block  = [[t0, t0, t0, t0, t1, t1],
        #                                             [u0, u0, u0, 0,  0,  0 ]]
        #                                    offset = [[0, 1, 2, 3, 0, 1]] * 2
        """
        seq_lens = self.decode_seq_lens
        block_size = self.block_size
        width = self.decode_context_len or int(seq_lens.max())
        positions = torch.arange(width, device=seq_lens.device).unsqueeze(0)
        visible = positions < seq_lens.unsqueeze(1)
        if self.sliding_window is not None:
            visible &= positions > seq_lens.unsqueeze(1) - 1 - self.sliding_window
        columns = (positions // block_size).expand(len(seq_lens), -1)
        blocks = torch.where(visible, self.decode_block_table.gather(1, columns), 0)
        return blocks, (positions % block_size).expand_as(blocks), visible


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends over the whole context.

    A backend with `fuses_rotary` takes q and k before rotation (`forward_rotary`) and rotates
    them in the kernel that writes the cache; the others get them rotated (`forward`).

    `kv_cache` is one layer's view of the block-contiguous cache: [num_blocks, 2, block_size,
    num_kv_heads, head_dim] (index 0 = K, 1 = V). Prefills and decodes of one step come
    together; the causal mask is aligned bottom-right, so a chunk or a request with prefix hits
    sees its whole cached context.
    """

    fuses_rotary = False

    def layer_ops(self) -> LayerOps:
        """The elementwise ops the model's layers run beside this backend (torch's)."""
        return TORCH_LAYER_OPS

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

    def forward_rotary(
        self,
        q: torch.Tensor,  # [T, Hq, D], not rotated yet
        k: torch.Tensor,  # [T, Hkv, D], not rotated yet
        v: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """forward() of q and k rotated by `rope` (backends with fuses_rotary override it)."""
        return self.forward(rope.apply(q), rope.apply(k), v, kv_cache, metadata, scale)
