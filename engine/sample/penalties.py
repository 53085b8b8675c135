"""Repetition, frequency and presence penalties, vectorised over the batch."""

from __future__ import annotations

import torch

from engine.sample.metadata import SamplingMetadata


def token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] int64: how often each token id occurs in each row's list.

    One flat scatter-add instead of a loop over tokens:
    # lists = [[5, 5], [2]], V = 8  ->  flat ids = [0*8+5, 0*8+5, 1*8+2] = [5, 5, 10]
    """
    num_rows = len(token_lists)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.int64, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device=device)
    flat = [t for tokens in token_lists for t in tokens]
    if flat:
        token_ids = torch.tensor(flat, dtype=torch.int64, device=device)
        rows = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
        # A token id past the logits' width cannot be penalised: drop it.
        keep = token_ids < vocab_size
        flat_index = rows[keep] * vocab_size + token_ids[keep]
        counts.index_add_(0, flat_index, torch.ones_like(flat_index))
    return counts.view(num_rows, vocab_size)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Penalise tokens already seen, in vLLM's order: repetition, frequency, presence.

    repetition: for tokens in the prompt or the output, positive logits are divided by the
    penalty and negative ones multiplied (both push the token down when penalty > 1).
    frequency / presence: subtract penalty * count / penalty * [count > 0], output tokens only.
    """
    rep = metadata.repetition_penalties
    freq = metadata.frequency_penalties
    pres = metadata.presence_penalties
    if rep is None and freq is None and pres is None:
        return logits
    vocab_size = logits.shape[1]
    output_counts = token_counts(metadata.output_token_ids, vocab_size, logits.device)
    if rep is not None:
        prompt_counts = token_counts(metadata.prompt_token_ids, vocab_size, logits.device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        factor = torch.where(seen, rep.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    if freq is not None:
        logits = logits - freq.unsqueeze(1) * output_counts
    if pres is not None:
        logits = logits - pres.unsqueeze(1) * (output_counts > 0)
    return logits
