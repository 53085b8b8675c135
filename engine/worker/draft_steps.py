"""The model runner's side of verifying drafts (engine/spec_decode/verify.py says which
tokens are kept): sampling at every draft position, then keeping the accepted ones."""

from __future__ import annotations

import numpy as np
import torch

from engine.core.sched_output import ModelRunnerOutput
from engine.sample import Sampler, SamplingMetadata
from engine.sample.logits_processor import LogitsProcessors
from engine.spec_decode.verify import DraftVerification
from engine.worker.input_batch import InputBatch
from engine.worker.step_inputs import StepPlan

_NO_PROCESSORS = LogitsProcessors()


def sample_drafted(
    batch: InputBatch,
    sampler: Sampler,
    generator: torch.Generator,
    all_logits: torch.Tensor,
    verification: DraftVerification,
    plan: StepPlan,
) -> list[int]:
    """A token at every draft position, sampled as plain decoding would sample it there:
    the request's params at output position outputs-so-far + j (no processors: requests
    that have any do not speculate). Indexed by computed-logits row."""
    rows, js = verification.draft_rows()
    params, prompts, outputs = [], [], []
    for request_index, j in zip(
        np.repeat(np.arange(len(plan.rows)), verification.num_drafts),
        js.tolist(),
        strict=True,
    ):
        state = batch.states[int(plan.rows[request_index])]
        assert state is not None
        params.append(state.sampling_params)
        prompts.append(state.prompt_token_ids)
        drafts = verification.drafts[request_index]
        outputs.append(state.output_token_ids + drafts[:j])
    metadata = SamplingMetadata.build(
        params, prompts, outputs, _NO_PROCESSORS, all_logits.device, generator
    )
    predictions = [0] * all_logits.shape[0]
    sampled = sampler.sample(all_logits[torch.from_numpy(rows)], metadata).tolist()
    for row, token in zip(rows.tolist(), sampled, strict=True):
        predictions[row] = token
    return predictions


def keep_accepted(
    batch: InputBatch,
    output: ModelRunnerOutput,
    plan: StepPlan,
    verification: DraftVerification,
    predictions: list[int],
) -> None:
    """Extend each verified request's sampled token with its accepted drafts' successors;
    rejected drafts are not computed tokens."""
    for i, row in enumerate(plan.rows.tolist()):
        num_drafts = int(verification.num_drafts[i])
        if not num_drafts or not output.sampled_token_ids[i]:
            continue
        tokens = verification.accepted(i, output.sampled_token_ids[i][0], predictions)
        for token in tokens[1:]:
            batch.append_token(row, token)
        output.sampled_token_ids[i] = tokens
        batch.num_computed_tokens[row] -= num_drafts - (len(tokens) - 1)
        state = batch.states[row]
        assert state is not None
        state.num_computed_tokens = int(batch.num_computed_tokens[row])
