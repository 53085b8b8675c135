"""GPU fast path: every prefill of a step in one padded attention call.

On a GPU a Python loop of small kernels costs more than the padding it avoids, so prefills are
batched like decodes. The code is device-agnostic (the unit tests run it on CPU against the
reference); `get_attention_backend` picks it for CUDA devices and imports it only then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention.backend import AttentionMetadata
from engine.layers.attention.torch_ref import TorchReferenceBackend, _visible, gather_context


class CudaBackend(TorchReferenceBackend):
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
        device = q.device
        prefills = md.prefills
        block_size = kv_cache.shape[2]
        starts = torch.tensor([p.query_start for p in prefills], device=device)
        q_lens = torch.tensor([p.query_len for p in prefills], device=device)
        seq_lens = torch.tensor([p.seq_len for p in prefills], device=device)
        rows = torch.tensor([p.row for p in prefills], device=device)
        max_q = max(p.query_len for p in prefills)
        num_blocks = -(-max(p.seq_len for p in prefills) // block_size)
        keys, values = gather_context(kv_cache, md.block_table[rows, :num_blocks])  # [P, S, ..]
        offsets = torch.arange(max_q, device=device)
        valid_q = offsets.unsqueeze(0) < q_lens.unsqueeze(1)  # [P, Q]
        token_idx = (starts.unsqueeze(1) + offsets).clamp(max=q.shape[0] - 1)  # [P, Q]
        query_pos = (seq_lens - q_lens).unsqueeze(1) + offsets  # [P, Q]
        key_pos = torch.arange(keys.shape[1], device=device)
        mask = _visible(query_pos.unsqueeze(2), key_pos.view(1, 1, -1), md.sliding_window)
        mask &= (key_pos.view(1, -1) < seq_lens.unsqueeze(1)).unsqueeze(1)
        # Padding queries see key 0 only, so their (discarded) rows are not NaN.
        mask[..., 0] |= ~valid_q
        attended = F.scaled_dot_product_attention(
            q[token_idx].transpose(1, 2),  # [P, Hq, Q, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask.unsqueeze(1),
            scale=scale,
            enable_gqa=True,
        )
        out[token_idx[valid_q]] = attended.transpose(1, 2)[valid_q]
