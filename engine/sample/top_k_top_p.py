"""Top-k and top-p (nucleus) truncation, vectorised over the batch."""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set truncated tokens to -inf. top_k <= 0 and top_p == 1.0 leave a row alone.

    Tokens tied with the k-th largest logit are all kept, so a row's support never depends
    on the order in which equal logits happen to be sorted.
    """
    if top_p is None:
        return logits if top_k is None else _apply_top_k_only(logits, top_k)
    # Ascending stable sort: ties keep vocabulary order on every device and batch shape.
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, stable=True)
    vocab_size = logits.shape[1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    probs_sorted = torch.softmax(sorted_logits, dim=-1)
    cumulative = torch.cumsum(probs_sorted, dim=-1)
    # Drop the low tail whose mass fits within 1 - p; the top token always stays.
    drop_sorted = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop_sorted[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop_sorted, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # torch.topk with the largest k in the batch is far cheaper than a full vocabulary sort.
    vocab_size = logits.shape[1]
    enabled = top_k > 0
    k = torch.where(enabled, top_k.clamp(max=vocab_size), 1)
    max_k = int(k.max().item())
    top_values = torch.topk(logits, max_k, dim=-1).values
    kth_largest = top_values.gather(1, (k - 1).unsqueeze(1))
    kth_largest = torch.where(enabled.unsqueeze(1), kth_largest, float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))
