"""The thinking-budget logits processor: forcing the end of a reasoning section on budget."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from engine.sample.logits_processor import LogitsProcessorConfig, ThinkingBudgetLogitsProcessor
from tests.unit.logits_utils import (
    CONFIG,
    CPU,
    EOS,
    SWAP,
    THINK_END,
    THINK_START,
    UNI,
    V,
    add,
    update,
)


def forced_rows(proc: ThinkingBudgetLogitsProcessor, batch_size: int) -> list[int]:
    out = proc.apply(torch.zeros(batch_size, V))
    rows = []
    for i in range(batch_size):
        if torch.isfinite(out[i]).sum() == 1:
            assert out[i, THINK_END] == 0.0
            rows.append(i)
        else:
            assert torch.isfinite(out[i]).all()
    return rows


def test_thinking_budget_forces_end_after_exactly_budget_tokens() -> None:
    proc = ThinkingBudgetLogitsProcessor(CONFIG, CPU)
    out: list[int] = [1]
    proc.update_state(update(1, added=(add(0, out, thinking_token_budget=2),)))
    assert forced_rows(proc, 1) == []
    for token_id in (THINK_START, 1):  # start, then 1 thinking token
        out.append(token_id)
        proc.update_state(None)
        assert forced_rows(proc, 1) == []
    out.append(2)  # the second thinking token: budget spent
    proc.update_state(None)
    assert forced_rows(proc, 1) == [0]
    proc.update_state(None)  # no new token: still forced
    assert forced_rows(proc, 1) == [0]
    out.append(THINK_END)
    proc.update_state(None)
    assert forced_rows(proc, 1) == []
    out.extend([THINK_START, 1, 2, 3, 4])  # a second section is not limited
    proc.update_state(None)
    assert forced_rows(proc, 1) == []


def test_thinking_budget_zero_forces_end_right_after_start() -> None:
    proc = ThinkingBudgetLogitsProcessor(CONFIG, CPU)
    out: list[int] = []
    proc.update_state(update(1, added=(add(0, out, thinking_token_budget=0),)))
    assert forced_rows(proc, 1) == []
    out.append(THINK_START)
    proc.update_state(None)
    assert forced_rows(proc, 1) == [0]


def test_thinking_end_emitted_before_budget_never_forces() -> None:
    proc = ThinkingBudgetLogitsProcessor(CONFIG, CPU)
    out = [THINK_START, 1, THINK_END]
    proc.update_state(update(1, added=(add(0, out, thinking_token_budget=3),)))
    for token_id in (1, 2, 3, 4, 1, 2):
        out.append(token_id)
        proc.update_state(None)
        assert forced_rows(proc, 1) == []


def test_thinking_not_configured_is_a_no_op() -> None:
    config = LogitsProcessorConfig(vocab_size=V, max_num_seqs=4, eos_token_id=EOS)
    proc = ThinkingBudgetLogitsProcessor(config, CPU)
    params = SamplingParams(thinking_token_budget=0)
    proc.update_state(update(1, added=((0, params, [0], [THINK_START, 1, 2]),)))
    assert forced_rows(proc, 1) == []
    with pytest.raises(ValueError, match="reasoning"):
        proc.validate_params(params)
    # A request without a budget is untouched even on a configured model.
    proc = ThinkingBudgetLogitsProcessor(CONFIG, CPU)
    proc.update_state(update(1, added=(add(0, [THINK_START, 1, 2, 3]),)))
    assert forced_rows(proc, 1) == []


def test_thinking_started_in_prompt_counts_prompt_tokens() -> None:
    proc = ThinkingBudgetLogitsProcessor(CONFIG, CPU)
    out: list[int] = []
    prompt = [1, THINK_START, 2]  # the chat template opened the section; 1 token used
    proc.update_state(update(1, added=(add(0, out, prompt, thinking_token_budget=2),)))
    assert forced_rows(proc, 1) == []
    out.append(3)
    proc.update_state(None)
    assert forced_rows(proc, 1) == [0]
    # A prompt that closed its section does not start one.
    proc.update_state(
        update(1, added=(add(0, [], [THINK_START, THINK_END], thinking_token_budget=0),))
    )
    assert forced_rows(proc, 1) == []


def test_thinking_state_catches_up_on_existing_outputs_and_moves() -> None:
    proc = ThinkingBudgetLogitsProcessor(CONFIG, CPU)
    # A decode engine receives requests with outputs from the prefill engine already there.
    out_a = [THINK_START, 1, 2]
    out_b = [THINK_START]
    proc.update_state(
        update(
            2,
            added=(
                add(0, out_a, thinking_token_budget=2),
                add(1, out_b, thinking_token_budget=2),
            ),
        )
    )
    assert forced_rows(proc, 2) == [0]
    proc.update_state(update(2, moved=((0, 1, SWAP),)))
    assert forced_rows(proc, 2) == [1]
    proc.update_state(update(3, moved=((1, 2, UNI),)))
    assert forced_rows(proc, 3) == [2]
    proc.update_state(update(3, removed=(2,)))
    assert forced_rows(proc, 3) == []


def test_thinking_state_is_incremental_not_rescanned() -> None:
    proc = ThinkingBudgetLogitsProcessor(CONFIG, CPU)
    out = [THINK_START, 1]
    proc.update_state(update(1, added=(add(0, out, thinking_token_budget=2),)))
    # Overwrite an already-read token: a rescan would no longer see the section start, the
    # incremental state still counts the one new token and reaches the budget.
    out[0] = 3
    out.append(2)
    proc.update_state(None)
    assert forced_rows(proc, 1) == [0]
