"""Flattening one step's scheduled tokens into model inputs (vectorised, numpy)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.kv_cache_utils import cdiv
from engine.layers.attention import AttentionMetadata, PrefillSlice
from engine.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    rows: np.ndarray  # [R] batch rows of the scheduled requests, ascending
    num_scheduled: np.ndarray  # [R]
    logits_indices: torch.Tensor  # [R] last token of each scheduled request
    completes_prompt: np.ndarray  # [R] bool: this step reaches the request's last token


@dataclass
class StepPlan:
    """Which rows compute how many tokens from where: the host-side part of a step's inputs."""

    rows: np.ndarray  # [R] batch rows of the scheduled requests, ascending
    num_scheduled: np.ndarray  # [R]
    computed: np.ndarray  # [R] tokens already computed
    is_decode: np.ndarray  # [R] bool: attends token by token (one token, or a verification)

    @property
    def all_decode(self) -> bool:
        """Every row decodes one token (what a captured decode graph stages)."""
        return bool(self.is_decode.all()) and bool((self.num_scheduled == 1).all())

    def completes_prompt(self, batch: InputBatch) -> np.ndarray:
        """[R] bool: this step reaches the request's last token (so it samples)."""
        return self.computed + self.num_scheduled >= batch.num_tokens[self.rows]


def plan_step(
    batch: InputBatch,
    num_scheduled_tokens: dict[str, int],
    verifying: Collection[str] = (),
    token_by_token: bool = False,
) -> StepPlan:
    """Decodes (one token) are batched for attention token by token. So are the tokens of the
    requests in `verifying` (a last token and its drafts): every layer writes the step's K/V
    before attending, so token j attending over positions [0, its own] through the request's
    block table is exactly causal attention — and a step of decodes and verifications stays
    a decode-only step (the fused CPU step takes it).

    With `token_by_token` every token is (the engine argument `batch_invariant`). A prompt's
    chunk then computes each token as a decode computes it, bit for bit, wherever the chunk
    starts and ends: a prefill's attention (SDPA over the chunk) gives the same values but
    for their last bits, which depend on the chunk's length. So an answer no longer depends
    on how its prompt was chunked, batched, cached, preempted or migrated. The decode block
    table is then one row per token (`[tokens, context blocks]` per step)."""
    rows = np.array(
        sorted(batch.req_id_to_index[req_id] for req_id in num_scheduled_tokens), dtype=np.int64
    )
    req_ids = batch.req_ids
    num_scheduled = np.array([num_scheduled_tokens[req_ids[r] or ""] for r in rows], np.int64)
    is_decode = np.full(len(rows), True) if token_by_token else num_scheduled == 1
    if verifying and not token_by_token:
        is_decode |= np.array([req_ids[r] in verifying for r in rows], dtype=bool)
    return StepPlan(rows, num_scheduled, batch.num_computed_tokens[rows], is_decode)


def prepare_step_inputs(
    batch: InputBatch, plan: StepPlan, device: torch.device, sliding_window: int | None
) -> StepInputs:
    """Tokens of every scheduled request, one after the other, in batch-row order.

    # num_scheduled = [2, 5, 3]  ->  req_of_token = [0,0, 1,1,1,1,1, 2,2,2]
    #                                offsets      = [0,1, 0,1,2,3,4, 0,1,2]
    # positions = num_computed_tokens[req] + offsets
    """
    return build_step_inputs(
        batch, plan.rows, plan.computed, plan.num_scheduled, plan.is_decode, device, sliding_window
    )


def build_step_inputs(
    batch: InputBatch,
    rows: np.ndarray,
    computed: np.ndarray,
    num_scheduled: np.ndarray,
    is_decode: np.ndarray,
    device: torch.device,
    sliding_window: int | None,
) -> StepInputs:
    """Inputs for `num_scheduled[i]` tokens of batch row `rows[i]` (ascending) from position
    `computed[i]` on, read from the batch's token ids and block table; `is_decode[i]` batches
    row i's tokens for attention token by token. The target's steps and a draft model's
    (engine/worker/draft_model.py) both come through here."""
    ends = np.cumsum(num_scheduled)
    starts = ends - num_scheduled
    req_of_token = np.repeat(np.arange(len(rows)), num_scheduled)
    offsets = np.arange(int(ends[-1])) - np.repeat(starts, num_scheduled)
    positions = computed[req_of_token] + offsets
    token_rows = rows[req_of_token]
    slot_block, slot_offset = batch.block_table.slot_mapping(token_rows, positions)
    seq_lens = computed + num_scheduled
    block_size = batch.block_table.block_size
    table = batch.block_table.table[rows, : cdiv(int(seq_lens.max()), block_size)]
    decode_tokens = np.nonzero(is_decode[req_of_token])[0]
    prefills = [
        PrefillSlice(int(i), int(starts[i]), int(num_scheduled[i]), int(seq_lens[i]))
        for i in np.nonzero(~is_decode)[0]
    ]

    def t(array: np.ndarray) -> torch.Tensor:
        # Writable and contiguous: torch refuses to share read-only (broadcast) arrays.
        return torch.from_numpy(np.require(array, requirements=("C", "W"))).to(device)

    metadata = AttentionMetadata(
        num_tokens=int(ends[-1]),
        block_size=block_size,
        slot_block=t(slot_block),
        slot_offset=t(slot_offset),
        block_table=t(table),
        decode_token_indices=t(decode_tokens),
        decode_block_table=t(table[req_of_token[decode_tokens]]),
        decode_seq_lens=t(positions[decode_tokens] + 1),
        prefills=prefills,
        decode_max_seq_len=int(positions[decode_tokens].max()) + 1 if len(decode_tokens) else 0,
        sliding_window=sliding_window,
    )
    return StepInputs(
        input_ids=t(batch.token_ids[token_rows, positions]),
        positions=t(positions),
        attn_metadata=metadata,
        rows=rows,
        num_scheduled=num_scheduled,
        logits_indices=t(ends - 1),
        completes_prompt=seq_lens >= batch.num_tokens[rows],
    )
