"""Logits processors: batch updates, per-row state through add/remove/move, custom loading."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.request import SamplingParams
from engine.sample.logits_processor import (
    BatchUpdate,
    BatchUpdateBuilder,
    ForcedOutputLogitsProcessor,
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    LogitsProcessorConfig,
    LogitsProcessors,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    ThinkingBudgetLogitsProcessor,
    build_logits_processors,
    load_custom_logits_processor,
)
from engine.sample.logits_processor.structured import StructuredOutputLogitsProcessor
from tests.unit.logits_utils import (
    CONFIG,
    CPU,
    INF,
    SWAP,
    UNI,
    V,
    add,
    applied,
    row,
    update,
)


class MyProc(LogitsProcessor):
    """Bans the token named by extra_args["ban"] in that request's row."""

    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.banned: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.banned.pop(index, None)
        for index, params, _, _ in batch_update.added:
            if "ban" in params.extra_args:
                self.banned[index] = params.extra_args["ban"]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, token_id in self.banned.items():
            logits[index, token_id] = -INF
        return logits


class MyMinP(LogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class NotAProcessor:
    pass


# --- BatchUpdateBuilder -------------------------------------------------------------------


def test_builder_returns_none_when_nothing_changed() -> None:
    builder = BatchUpdateBuilder()
    assert builder.get_and_reset(3) is None
    assert builder.pop_removed() is None


def test_builder_freezes_changes_in_order_and_resets() -> None:
    builder = BatchUpdateBuilder()
    params = SamplingParams()
    out: list[int] = []
    builder.removed_append(4)
    builder.removed_append(1)
    builder.added_append((2, params, [9], out))
    builder.added_append((0, params, [8], out))
    builder.moved_append((3, 1, UNI))
    builder.moved_append((0, 2, SWAP))
    update = builder.get_and_reset(4)
    assert update is not None
    assert update.batch_size == 4
    assert list(update.removed) == [1, 4]
    assert [a[0] for a in update.added] == [2, 0]
    assert update.added[0][3] is out  # the live list, not a copy
    assert list(update.moved) == [(3, 1, UNI), (0, 2, SWAP)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.batch_size = 5  # type: ignore[misc]
    # Appends after the freeze go to the next step, not into the returned update.
    builder.removed_append(0)
    assert list(update.removed) == [1, 4]
    nxt = builder.get_and_reset(3)
    assert nxt is not None and list(nxt.removed) == [0]
    assert builder.get_and_reset(3) is None


def test_builder_pop_removed_gives_lowest_hole_first() -> None:
    builder = BatchUpdateBuilder()
    for index in (5, 2, 7):
        builder.removed_append(index)
    assert builder.pop_removed() == 2
    assert builder.pop_removed() == 5
    update = builder.get_and_reset(8)
    assert update is not None and list(update.removed) == [7]


def test_builder_rejects_bad_entries() -> None:
    builder = BatchUpdateBuilder()
    with pytest.raises(ValueError, match="row index"):
        builder.removed_append(-1)
    with pytest.raises(ValueError, match="MoveDirectionality"):
        builder.moved_append((0, 1, "swap"))  # type: ignore[arg-type]


# --- LogitBias: the generic state bookkeeping --------------------------------------------


def test_logit_bias_follows_add_swap_move_remove() -> None:
    proc = LogitBiasLogitsProcessor(CONFIG, CPU)
    assert not proc.is_argmax_invariant()
    proc.update_state(
        update(
            3,
            added=(
                add(0, logit_bias={1: 2.0, 4: -0.5}),
                add(1, logit_bias={3: -1.0}),
                add(2),
            ),
        )
    )
    assert applied(proc, 3).tolist() == [row(t1=2.0, t4=-0.5), row(t3=-1.0), row()]
    proc.update_state(None)
    assert applied(proc, 3).tolist() == [row(t1=2.0, t4=-0.5), row(t3=-1.0), row()]
    proc.update_state(update(3, moved=((0, 1, SWAP),)))
    assert applied(proc, 3).tolist() == [row(t3=-1.0), row(t1=2.0, t4=-0.5), row()]
    proc.update_state(update(3, moved=((1, 2, UNI),)))
    assert applied(proc, 3).tolist() == [row(t3=-1.0), row(), row(t1=2.0, t4=-0.5)]
    proc.update_state(update(3, removed=(0,)))
    assert applied(proc, 3).tolist() == [row(), row(), row(t1=2.0, t4=-0.5)]


def test_removed_then_added_then_moved_order() -> None:
    proc = LogitBiasLogitsProcessor(CONFIG, CPU)
    proc.update_state(update(2, added=(add(0, logit_bias={1: 1.0}), add(1, logit_bias={2: 1.0}))))
    # Row 1 freed and refilled in one step, then the new row 1 moves to row 0 (condense-style:
    # row 0's old request is overwritten by the unidirectional move).
    proc.update_state(
        update(2, removed=(1,), added=(add(1, logit_bias={3: 5.0}),), moved=((1, 0, UNI),))
    )
    assert applied(proc, 2).tolist() == [row(t3=5.0), row()]


def test_added_request_without_bias_clears_previous_occupant() -> None:
    proc = LogitBiasLogitsProcessor(CONFIG, CPU)
    proc.update_state(update(1, added=(add(0, logit_bias={1: 1.0}),)))
    proc.update_state(update(1, added=(add(0),)))
    assert applied(proc, 1).tolist() == [row()]


def test_logit_bias_rejects_token_outside_vocab_without_touching_state() -> None:
    proc = LogitBiasLogitsProcessor(CONFIG, CPU)
    proc.update_state(update(1, added=(add(0, logit_bias={1: 1.0}),)))
    bad = update(2, removed=(0,), added=(add(1, logit_bias={V: 1.0}),))
    with pytest.raises(ValueError, match=rf"token id {V}.*vocab size {V}"):
        proc.update_state(bad)
    assert applied(proc, 2).tolist() == [row(t1=1.0), row()]
    with pytest.raises(ValueError, match="vocab size"):
        proc.validate_params(SamplingParams(logit_bias={V + 3: 1.0}))


# --- MinTokens -----------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    proc = MinTokensLogitsProcessor(CONFIG, CPU)
    out0: list[int] = []
    out1: list[int] = [1]
    proc.update_state(
        update(
            3,
            added=(
                add(0, out0, min_tokens=2, stop_token_ids=[3]),
                add(1, out1, min_tokens=2, stop_token_ids=[3, 100], ignore_eos=True),
                add(2, min_tokens=0, stop_token_ids=[3]),
            ),
        )
    )
    assert applied(proc, 3).tolist() == [row(t3=-INF, t7=-INF), row(t3=-INF), row()]
    out0.append(4)
    out1.append(4)  # row 1 reaches min_tokens=2
    proc.update_state(None)
    assert applied(proc, 3).tolist() == [row(t3=-INF, t7=-INF), row(), row()]
    out0.append(4)
    proc.update_state(None)
    assert applied(proc, 3).tolist() == [row(), row(), row()]


def test_forced_output_tokens_win_then_release_the_row() -> None:
    proc = ForcedOutputLogitsProcessor(CONFIG, CPU)
    out0: list[int] = []
    out1: list[int] = []
    proc.update_state(update(3, added=(add(0, out0, forced_output_token_ids=[4, 2]), add(1, out1))))
    logits = torch.zeros(3, V)
    logits[0, 4] = -INF  # masked by an earlier processor: still forced, and finite
    first = proc.apply(logits)
    assert first[0].tolist() == row(**{f"t{i}": -INF for i in range(V) if i != 4})
    assert first[1].tolist() == row() and first[2].tolist() == row()
    out0.append(4)
    proc.update_state(None)
    assert applied(proc, 3)[0].tolist() == row(**{f"t{i}": -INF for i in range(V) if i != 2})
    out0.append(2)
    proc.update_state(None)  # both forced tokens emitted: the row samples freely again
    assert applied(proc, 3).tolist() == [row(), row(), row()]


def test_forced_output_tokens_are_validated() -> None:
    proc = ForcedOutputLogitsProcessor(CONFIG, CPU)
    with pytest.raises(ValueError, match="vocab size"):
        proc.validate_params(SamplingParams(forced_output_token_ids=[V]))
    with pytest.raises(ValueError, match="at most max_tokens"):
        SamplingParams(max_tokens=1, forced_output_token_ids=[1, 2])


def test_min_tokens_follows_moves_and_removal() -> None:
    proc = MinTokensLogitsProcessor(CONFIG, CPU)
    proc.update_state(
        update(
            2,
            added=(add(0, min_tokens=5), add(1, min_tokens=5, stop_token_ids=[2], ignore_eos=True)),
        )
    )
    proc.update_state(update(2, moved=((0, 1, SWAP),)))
    assert applied(proc, 2).tolist() == [row(t2=-INF), row(t7=-INF)]
    proc.update_state(update(3, moved=((1, 2, UNI),)))
    assert applied(proc, 3).tolist() == [row(t2=-INF), row(), row(t7=-INF)]
    proc.update_state(update(3, removed=(0, 2)))
    assert applied(proc, 3).tolist() == [row(), row(), row()]


# --- MinP ----------------------------------------------------------------------------------


def test_min_p_drops_tokens_below_fraction_of_top_probability() -> None:
    proc = MinPLogitsProcessor(CONFIG, CPU)
    assert proc.is_argmax_invariant()
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01])
    proc.update_state(update(3, added=(add(0, min_p=0.5), add(1), add(2, min_p=0.3))))
    out = proc.apply(probs.log().repeat(3, 1))
    assert torch.isfinite(out[0]).tolist() == [True, True] + [False] * 6
    assert torch.isfinite(out[1]).all()
    assert torch.isfinite(out[2]).tolist() == [True, True, True] + [False] * 5
    proc.update_state(update(3, moved=((0, 1, SWAP),)))
    out = proc.apply(probs.log().repeat(3, 1))
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).sum() == 2
    proc.update_state(update(3, removed=(1,), moved=((2, 0, UNI),)))
    out = proc.apply(probs.log().repeat(3, 1))
    assert torch.isfinite(out).sum(dim=1).tolist() == [3, V, V]


# --- Container, builder and custom classes ------------------------------------------------


def test_build_splits_builtins_by_argmax_invariance() -> None:
    procs = build_logits_processors(CONFIG, CPU)
    assert [type(p) for p in procs.non_argmax_invariant] == [
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
        ThinkingBudgetLogitsProcessor,
        StructuredOutputLogitsProcessor,
        ForcedOutputLogitsProcessor,
    ]
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor]
    assert len(procs.all) == 6
    with pytest.raises(ValueError, match="vocab size"):
        procs.validate_params(SamplingParams(logit_bias={V: 1.0}))


@pytest.mark.parametrize(
    "spec",
    [
        "tests.unit.test_logits_processors.MyProc",
        "tests.unit.test_logits_processors:MyProc",
        MyProc,
    ],
)
def test_custom_processor_loaded_and_driven(spec: str | type) -> None:
    procs = build_logits_processors(CONFIG, CPU, custom=[spec, MyMinP])
    custom = procs.non_argmax_invariant[-1]
    assert type(custom) is MyProc
    assert type(procs.argmax_invariant[-1]) is MyMinP
    procs.update_state(update(2, added=(add(1, extra_args={"ban": 4}),)))
    out = custom.apply(torch.zeros(2, V))
    assert out.tolist() == [row(), row(t4=-INF)]


def test_load_custom_by_fqcn_forms() -> None:
    assert load_custom_logits_processor("tests.unit.test_logits_processors.MyProc") is MyProc
    assert load_custom_logits_processor("tests.unit.test_logits_processors:MyProc") is MyProc


@pytest.mark.parametrize(
    ("fqcn", "message"),
    [
        ("no_such_package_xyz.mod.Proc", "cannot import module 'no_such_package_xyz.mod'"),
        ("tests.unit.test_logits_processors:Nope", "has no class 'Nope'"),
        ("tests.unit.test_logits_processors.Nope", "has no class 'Nope'"),
        ("tests.unit.test_logits_processors:NotAProcessor", "not a subclass of LogitsProcessor"),
        ("tests.unit.test_logits_processors:CPU", "not a subclass of LogitsProcessor"),
        ("JustAName", "expected 'package.module.Class'"),
    ],
)
def test_load_custom_errors(fqcn: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_custom_logits_processor(fqcn)


def test_build_rejects_class_that_is_not_a_processor() -> None:
    with pytest.raises(ValueError, match="not a subclass"):
        build_logits_processors(CONFIG, CPU, custom=[NotAProcessor])


def test_container_update_state_reaches_every_processor() -> None:
    procs = LogitsProcessors([MyProc(CONFIG, CPU), MyMinP(CONFIG, CPU)])
    procs.update_state(update(1, added=(add(0, extra_args={"ban": 2}),)))
    assert isinstance(procs.non_argmax_invariant[0], MyProc)
    assert procs.non_argmax_invariant[0].banned == {0: 2}


def test_config_rejects_token_ids_outside_vocab() -> None:
    with pytest.raises(ValueError, match="eos_token_id"):
        LogitsProcessorConfig(vocab_size=4, max_num_seqs=1, eos_token_id=4)
    with pytest.raises(ValueError, match="vocab_size"):
        LogitsProcessorConfig(vocab_size=0, max_num_seqs=1)
