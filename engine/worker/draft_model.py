"""Drafts from a smaller model (speculative method `draft_model`), on the worker side.

After each step the draft model proposes up to k tokens for every request that speculates:
it first catches up on the tokens it has not seen (the whole prompt the first time, then the
step's accepted tokens and its sampled one), which yields the first draft, then decodes k - 1
more, one token per request per forward pass. Drafts are greedy: every emitted token is the
target's own sample at its position (engine/spec_decode/verify.py), so the drafts' source
only decides how many are accepted, never what is emitted.

The draft model keeps its own KV cache on the target's block ids: a block holds the draft's
K/V for the same positions as the target's. The scheduler reserves k lookahead slots for a
speculating request, which is where the draft writes the K/V of its own drafts. Which of a
request's draft K/V is still good is known by the tokens it was computed for: the longest
prefix that matches the request's tokens now (accepted drafts keep theirs, a rejected one
and everything after it are recomputed). A request starts from nothing on this engine even
where its target KV came from a prefix hit or another engine: the draft KV in a shared block
is a function of the tokens before it, so writing it again writes the same values.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.layers.attention import AttentionBackend
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.worker.input_batch import InputBatch
from engine.worker.kv_cache import KVCacheSpec, allocate_kv_cache, layer_views
from engine.worker.step_inputs import build_step_inputs


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        arch: ModelArchConfig,
        num_speculative_tokens: int,
        max_model_len: int,
        backend: AttentionBackend,
        device: torch.device,
        max_tokens_per_pass: int,
    ) -> None:
        self.model = model
        self.max_tokens_per_pass = max_tokens_per_pass  # the engine's token budget
        self.arch = arch
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.backend = backend
        self.device = device
        self.kv_layers: list[torch.Tensor] = []
        # req_id -> the tokens whose draft K/V sits at positions 0 .. len - 1.
        self._kv_tokens: dict[str, np.ndarray] = {}

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.arch.num_hidden_layers,
            num_kv_heads=self.arch.num_key_value_heads,
            head_dim=self.arch.head_dim,
            block_size=block_size,
            dtype=dtype,
        )

    def initialize_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        cache = allocate_kv_cache(self.kv_cache_spec(block_size, dtype), num_blocks, self.device)
        self.kv_layers = layer_views(cache)

    def forget(self, req_id: str) -> None:
        """The request left the batch (finished, or preempted: its blocks are gone)."""
        self._kv_tokens.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: list[int]) -> dict[str, list[int]]:
        """Up to k greedy drafts for the request in each batch row (rows with no room for
        one get none): each continues the row's tokens as they stand after this step."""
        rows, room = self._rows_with_room(batch, rows)
        if not rows:
            return {}
        rows_np = np.array(rows, dtype=np.int64)
        lengths = batch.num_tokens[rows_np].astype(np.int64)
        valid = np.array([self._valid_prefix(batch, r) for r in rows], dtype=np.int64)
        counts = self._catch_up_counts(lengths - valid)
        drafts = self._forward(batch, rows_np, valid, counts)
        behind = np.nonzero(valid + counts < lengths)[0]
        for i in behind.tolist():  # caught up part of the way: no drafts this step
            req_id = batch.req_ids[rows[i]]
            assert req_id is not None
            self._kv_tokens[req_id] = batch.token_ids[rows[i], : valid[i] + counts[i]].copy()
        if behind.size:
            ready = np.nonzero(valid + counts >= lengths)[0]
            rows_np, lengths, room = rows_np[ready], lengths[ready], room[ready]
            rows = rows_np.tolist()
            drafts = [drafts[i] for i in ready.tolist()]
            if not rows:
                return {}
        proposals = [[d] for d in drafts]
        for step in range(1, int(room.max())):
            live = np.nonzero(room > step)[0]
            positions = lengths[live] + step - 1
            for i, position in zip(live.tolist(), positions.tolist(), strict=True):
                batch.token_ids[rows[i], position] = proposals[i][-1]
            ones = np.ones(len(live), dtype=np.int64)
            drafts = self._forward(batch, rows_np[live], positions, ones)
            for i, draft in zip(live.tolist(), drafts, strict=True):
                proposals[i].append(draft)
        out: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            req_id = batch.req_ids[row]
            assert req_id is not None
            written = int(lengths[i]) + len(proposals[i]) - 1  # the last draft is never fed
            self._kv_tokens[req_id] = batch.token_ids[row, :written].copy()
            out[req_id] = proposals[i]
        return out

    def _catch_up_counts(self, needed: np.ndarray) -> np.ndarray:
        """Tokens each row catches up on this step: all it needs while the step's total stays
        within the engine's token budget (a long prompt the draft has not seen, from a prefix
        hit or another engine, is caught up over several steps), at least one per row."""
        spare = needed - 1
        budget = max(self.max_tokens_per_pass - len(needed), 0)
        granted = np.clip(budget - (np.cumsum(spare) - spare), 0, spare)
        return 1 + granted

    def _rows_with_room(self, batch: InputBatch, rows: list[int]) -> tuple[list[int], np.ndarray]:
        """Rows that can take at least one draft, and how many each can: drafts stay inside the
        context and inside the slots the row holds (draft j's K/V goes at length + j - 1)."""
        kept: list[int] = []
        room: list[int] = []
        block_size = batch.block_table.block_size
        for row in sorted(rows):
            length = int(batch.num_tokens[row])
            slots = int(batch.block_table.num_blocks[row]) * block_size
            fit = min(self.k, self.max_model_len - length, slots - length + 1)
            if fit > 0 and slots >= length:
                kept.append(row)
                room.append(fit)
        return kept, np.array(room, dtype=np.int64)

    def _valid_prefix(self, batch: InputBatch, row: int) -> int:
        """How many of the row's leading positions hold draft K/V of its current tokens (at
        most all but the last token, which the catch-up feeds to get the first draft)."""
        req_id = batch.req_ids[row]
        known = self._kv_tokens.get(req_id or "")
        length = int(batch.num_tokens[row])
        if known is None:
            return 0
        n = min(len(known), length - 1)
        mismatch = np.nonzero(known[:n] != batch.token_ids[row, :n])[0]
        return int(mismatch[0]) if mismatch.size else n

    def _forward(
        self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray
    ) -> list[int]:
        """Run the draft model over `counts[i]` tokens of row `rows[i]` from `starts[i]`; the
        argmax after each row's last token."""
        inputs = build_step_inputs(
            batch, rows, starts, counts, counts == 1, self.device, self.arch.sliding_window
        )
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_layers, inputs.attn_metadata, self.backend
        )
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits.argmax(dim=-1).tolist()
