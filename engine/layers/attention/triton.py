"""The Triton backend: paged attention that reads KV blocks in place, with rotary fused into
the cache write (engine/layers/gpu/). The default on CUDA; on a CPU it runs under Triton's
interpreter (TRITON_INTERPRET=1), which is how the tests check it against the reference.

A step with prefills costs three launches per layer here — the rotary + KV write, the decode
kernel (plus a merge when a long context is split) and the prefill kernel — where the
reference gathers every sequence's blocks into a padded copy first. A decode-only step (every
CUDA graph's) costs one: the decode kernel rotates q and k and writes the step's K/V itself.
Nothing here reads a device value on the host, so decode steps capture into CUDA graphs as
they are.
"""

from __future__ import annotations

import torch

from engine.layers.attention.backend import AttentionBackend, AttentionMetadata
from engine.layers.gpu import attention_kernels, fused_ops, on_device
from engine.layers.gpu.decode_new_kv import NewTokenKV
from engine.layers.layer_ops import LayerOps, TritonLayerOps
from engine.layers.rotary import RopeTables

# Programs the decode split heuristic aims to fill on a CPU (interpreter): a few, so that the
# tests exercise the split-and-merge path as well.
_CPU_MULTIPROCESSORS = 4


class TritonBackend(AttentionBackend):
    fuses_rotary = True

    def __init__(self, device: torch.device, decode_splits: int | None = None) -> None:
        """`decode_splits` fixes the splits of every decode's context (tests); None picks them
        from the batch, the context and the GPU's multiprocessors."""
        if device.type == "cuda":
            self.multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.multiprocessors = _CPU_MULTIPROCESSORS
        self.decode_splits = decode_splits
        self.device = device

    def layer_ops(self) -> LayerOps:
        return TritonLayerOps(self.device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        with on_device(self.device):
            if _decode_only(metadata):
                new_kv = NewTokenKV(k, v, *_slots(metadata))
                return self._attend(q, kv_cache, metadata, scale, new_kv)
            fused_ops.kv_write(k, v, kv_cache, *_slots(metadata))
            return self._attend(q, kv_cache, metadata, scale)

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        slots = _slots(metadata)
        with on_device(self.device):
            if _decode_only(metadata):
                rows = fused_ops.rope_rows(rope.cos), fused_ops.rope_rows(rope.sin)
                new_kv = NewTokenKV(k, v, *slots, *rows)
                return self._attend(q, kv_cache, metadata, scale, new_kv)
            rotated = fused_ops.rotary_kv_write(q, k, v, rope.cos, rope.sin, kv_cache, *slots)
            return self._attend(rotated, kv_cache, metadata, scale)

    def _attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        new_kv: NewTokenKV | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # q may be a view
        if md.num_decodes:
            context = md.decode_context_len or md.decode_max_seq_len
            if not context:  # a caller that did not say: one read of the device
                context = int(md.decode_seq_lens.max())
            block_n = attention_kernels.decode_block_n(q.shape[2])
            splits = self.decode_splits or attention_kernels.decode_splits(
                md.num_decodes, kv_cache.shape[3], context, self.multiprocessors, block_n
            )
            attention_kernels.decode_attention(
                q, kv_cache, md.decode_block_table, md.decode_seq_lens,
                md.decode_token_indices, out, scale, md.sliding_window, context, splits,
                new_kv=new_kv,
            )  # fmt: skip
        if md.prefills:
            attention_kernels.prefill_attention(
                q, kv_cache, md.block_table, out, md.prefill_tensors,
                max(p.query_len for p in md.prefills), scale, md.sliding_window,
            )  # fmt: skip
        return out


def _decode_only(md: AttentionMetadata) -> bool:
    """Every token of the step is a decode's, one per request (a captured graph's step, for
    one). Not a verification's: its tokens, batched as decodes, read each other's K/V, which
    must be in the cache before any of them attends (on the H200 the parity suite's
    speculation tests failed when the decode kernel wrote them itself)."""
    return not md.prefills and md.num_decodes == md.num_tokens == md.block_table.shape[0]


def _slots(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    return md.slot_block, md.slot_offset
