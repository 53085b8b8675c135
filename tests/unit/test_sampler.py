"""Sampler: greedy exactness, truncation, counter-based seeded draws, penalties, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from engine.request import SamplingParams
from engine.sample import LogprobsOutput, Sampler, SamplerOutput, SamplingMetadata
from engine.sample.counter_rng import mix64
from engine.sample.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessorConfig,
    LogitsProcessors,
    build_logits_processors,
)
from engine.sample.penalties import apply_penalties, token_counts
from engine.sample.top_k_top_p import apply_top_k_top_p

CPU = torch.device("cpu")
V = 16
EOS = 15
THINK_START, THINK_END = 13, 14


def make_processors(vocab_size: int = V) -> LogitsProcessors:
    config = LogitsProcessorConfig(
        vocab_size=vocab_size,
        max_num_seqs=64,
        eos_token_id=EOS if vocab_size > EOS else None,
        reasoning_start_token_id=THINK_START if vocab_size > THINK_END else None,
        reasoning_end_token_id=THINK_END if vocab_size > THINK_END else None,
    )
    return build_logits_processors(config, CPU)


def metadata_for(
    params: Sequence[SamplingParams],
    outputs: Sequence[list[int]] | None = None,
    prompts: Sequence[list[int]] | None = None,
    vocab_size: int = V,
    generator: torch.Generator | None = None,
) -> SamplingMetadata:
    """A fresh persistent batch holding `params` in rows 0..B-1."""
    outs = [list(o) for o in outputs] if outputs is not None else [[] for _ in params]
    proms = [list(p) for p in prompts] if prompts is not None else [[0] for _ in params]
    procs = make_processors(vocab_size)
    builder = BatchUpdateBuilder()
    for i, p in enumerate(params):
        builder.added_append((i, p, proms[i], outs[i]))
    procs.update_state(builder.get_and_reset(len(params)))
    return SamplingMetadata.build(params, proms, outs, procs, CPU, generator=generator)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], **kw) -> SamplerOutput:
    return Sampler()(logits.clone(), metadata_for(params, **kw))


def tokens(logits: torch.Tensor, params: Sequence[SamplingParams], **kw) -> list[int]:
    return sample(logits, params, **kw).sampled_token_ids.tolist()


def seeded(n: int, base: int = 0, **kw) -> list[SamplingParams]:
    return [SamplingParams(seed=base + i, **kw) for i in range(n)]


def logits_from_probs(probs: Sequence[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(rows, 1)


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_is_exact_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6)] * 3
    out = sample(logits, greedy, vocab_size=50)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    mixed = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams()] * 2
    got = tokens(logits, mixed, vocab_size=50)
    assert [got[i] for i in (0, 3)] == [logits[i].argmax().item() for i in (0, 3)]


def test_greedy_first_index_wins_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert tokens(logits, [SamplingParams(temperature=0.0)], vocab_size=4) == [1]


# --- truncation restricts the support ------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    ("knobs", "allowed"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.75}, {0, 1}),  # tail 0.05 + 0.15 = 0.2 <= 0.25 dropped
        ({"top_p": 0.85}, {0, 1, 2}),  # only 0.05 <= 0.15 dropped
        ({"min_p": 0.5}, {0, 1}),  # threshold 0.25
        ({"min_p": 0.2}, {0, 1, 2}),  # threshold 0.1
        ({"top_k": 3, "top_p": 0.75}, {0, 1}),
        ({"temperature": 0.05}, {0}),  # p1/p0 = (0.6)^20 ~ 4e-5
    ],
)
def test_truncation_support(knobs: dict, allowed: set[int]) -> None:
    n = 600
    seen_seeded = set(tokens(logits_from_probs(PROBS, n), seeded(n, **knobs), vocab_size=4))
    unseeded = [SamplingParams(**knobs) for _ in range(n)]
    gen = torch.Generator().manual_seed(1)
    seen = set(tokens(logits_from_probs(PROBS, n), unseeded, vocab_size=4, generator=gen))
    assert seen_seeded == allowed
    assert seen == allowed


def test_min_p_applies_after_temperature() -> None:
    # At T=2 probabilities are ~sqrt(p): [.38, .29, .21, .12]; min_p=0.5 keeps tokens 0-2.
    n = 600
    params = seeded(n, min_p=0.5, temperature=2.0)
    assert set(tokens(logits_from_probs(PROBS, n), params, vocab_size=4)) == {0, 1, 2}


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(40, V, generator=torch.Generator().manual_seed(3))
    params = seeded(20, top_k=1, temperature=1.5) + [SamplingParams(top_k=1)] * 20
    assert tokens(logits, params) == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_ties_and_off_values_are_no_ops() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([1, -1]), None)
    assert torch.isfinite(out).tolist() == [[False, True, True, False], [True] * 4]
    out = apply_top_k_top_p(logits.clone(), torch.tensor([1, -1]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, True, False], [True] * 4]
    assert out[1].tolist() == logits[1].tolist()


def test_temperature_flattens_distribution() -> None:
    n = 400
    hot = set(tokens(logits_from_probs(PROBS, n), seeded(n, temperature=5.0), vocab_size=4))
    assert hot == {0, 1, 2, 3}


# --- counter-based seeded sampling -----------------------------------------------------------


def test_mix64_matches_unsigned_reference() -> None:
    # Guards the int64 emulation of uint64 arithmetic (wrapping multiply, logical shift).
    mask = (1 << 64) - 1

    def reference(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        return z - (1 << 64) if z >= 1 << 63 else z

    values = [0, 1, -1, 42, 2**62 + 12345, -(2**63), 2**63 - 1]
    assert mix64(torch.tensor(values)).tolist() == [reference(v) for v in values]


def request_logits() -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(7)) * 1.5


def draw_in_batch(position: int, batch_size: int, row: int, filler_seed: int) -> int:
    """Token of request R (seed 1234) at `position`, placed at `row` among other requests."""
    gen = torch.Generator().manual_seed(filler_seed)
    logits = torch.randn(batch_size, V, generator=gen)
    logits[row] = request_logits()
    kinds = [
        SamplingParams(seed=99, temperature=0.7),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=5, top_k=3),
    ]
    params = [kinds[(i + filler_seed) % len(kinds)] for i in range(batch_size)]
    outputs = [[1] * ((i * 3 + filler_seed) % 7) for i in range(batch_size)]
    params[row] = SamplingParams(seed=1234, temperature=0.9, top_p=0.95)
    outputs[row] = [2] * position
    return tokens(logits, params, outputs=outputs, generator=gen)[row]


def test_seeded_draw_is_independent_of_batch_composition() -> None:
    for position in range(24):
        alone = draw_in_batch(position, 1, 0, filler_seed=0)
        assert draw_in_batch(position, 1, 0, filler_seed=0) == alone
        assert draw_in_batch(position, 5, 0, filler_seed=1) == alone
        assert draw_in_batch(position, 8, 3, filler_seed=2) == alone
        assert draw_in_batch(position, 8, 7, filler_seed=3) == alone


def test_prefill_decode_split_reproduces_single_engine_sequence() -> None:
    # One engine samples positions 0..11; a "prefill" engine samples position 0 and a "decode"
    # engine, in a different batch, the rest: the sequences must agree.
    single = [draw_in_batch(pos, 1, 0, filler_seed=0) for pos in range(12)]
    split = [draw_in_batch(0, 3, 2, filler_seed=4)]
    split += [draw_in_batch(pos, 6, 1, filler_seed=5) for pos in range(1, 12)]
    assert split == single
    assert len(set(single)) > 1  # the position feeds the noise: not one token forever


def test_different_seeds_and_positions_draw_differently() -> None:
    n = 400
    uniform = torch.zeros(n, V)
    by_seed = tokens(uniform, seeded(n))
    by_seed_pos1 = tokens(uniform, seeded(n), outputs=[[0]] * n)
    by_position = tokens(uniform, [SamplingParams(seed=7)] * n, outputs=[[0] * i for i in range(n)])
    assert len(set(by_seed)) == V
    assert len(set(by_position)) == V
    # Independent uniform draws over 16 tokens agree ~1/16 of the time.
    agree = sum(a == b for a, b in zip(by_seed, by_seed_pos1, strict=True)) / n
    assert agree < 0.15


def test_seeded_draws_follow_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    by_seed = tokens(logits_from_probs(probs, n), seeded(n, base=10_000), vocab_size=4)
    by_pos = tokens(
        logits_from_probs(probs, n),
        [SamplingParams(seed=3)] * n,
        outputs=[[0] * i for i in range(n)],
        vocab_size=4,
    )
    for draws in (by_seed, by_pos):
        counts = torch.bincount(torch.tensor(draws), minlength=4).double()
        expected = torch.tensor(probs, dtype=torch.float64) * n
        chi2 = (((counts - expected) ** 2) / expected).sum().item()
        assert chi2 < 16.3  # df=3, p=0.001
        assert (counts / n - torch.tensor(probs, dtype=torch.float64)).abs().max() < 0.03


def test_unseeded_rows_use_the_given_generator() -> None:
    n = 64
    logits = torch.zeros(n, V)
    params = [SamplingParams() for _ in range(n)]
    first = tokens(logits, params, generator=torch.Generator().manual_seed(11))
    again = tokens(logits, params, generator=torch.Generator().manual_seed(11))
    other = tokens(logits, params, generator=torch.Generator().manual_seed(12))
    assert first == again
    assert first != other


# --- penalties, logit bias, min_tokens, thinking budget ------------------------------------

PENALTY_LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def test_penalties_exact_values() -> None:
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    md = metadata_for(params, outputs=[[3, 3, 1], [3]], prompts=[[0, 4], [0]], vocab_size=6)
    out = apply_penalties(torch.tensor([PENALTY_LOGITS] * 2), md)
    # seen = {0, 4} prompt + {3, 1} output; rep: 2/2, -2*2, 3/2, -1*2
    # then output counts {3: 2, 1: 1}: 1.5 - 2*0.5 - 0.25, -2 - 0.5 - 0.25
    assert out[0].tolist() == [1.0, -2.75, 0.5, 0.25, -4.0, 1.0]
    assert out[1].tolist() == PENALTY_LOGITS


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    params = [SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)]
    md = metadata_for(params, outputs=[[2]], prompts=[[0, 0, 3]], vocab_size=6)
    out = apply_penalties(torch.tensor([PENALTY_LOGITS]), md)
    assert out[0].tolist() == [2.0, -1.0, -1.5, 3.0, -2.0, 1.0]


def test_token_counts_scatter() -> None:
    counts = token_counts([[5, 5, 1], [], [0, 9]], 6, CPU)  # 9 is past the vocabulary
    assert counts.tolist() == [[0, 1, 0, 0, 0, 2], [0] * 6, [1, 0, 0, 0, 0, 0]]


def test_penalties_change_greedy_pick() -> None:
    logits = torch.tensor([PENALTY_LOGITS])
    greedy = SamplingParams(temperature=0.0)
    assert tokens(logits, [greedy], outputs=[[3, 3, 1]], vocab_size=6) == [3]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5)
    assert tokens(logits, [penalised], outputs=[[3, 3, 1]], vocab_size=6) == [0]


def test_logit_bias_moves_greedy_and_random_picks() -> None:
    logits = torch.zeros(3, V)
    logits[:, 4] = 5.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={9: 10.0}),
        SamplingParams(seed=1, logit_bias={9: 100.0, 4: -100.0}),
        SamplingParams(temperature=0.0),
    ]
    assert tokens(logits, params) == [9, 9, 4]


def test_bad_logit_bias_token_raises_when_added() -> None:
    params = [SamplingParams(logit_bias={V + 1: 1.0})]
    with pytest.raises(ValueError, match=rf"token id {V + 1}.*vocab size {V}"):
        metadata_for(params)


def test_min_tokens_masks_eos_and_stop_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS] = 9.0
    logits[0, 3] = 8.0
    logits[0, 2] = 7.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])]
    assert tokens(logits, params, outputs=[[]]) == [2]
    assert tokens(logits, params, outputs=[[1]]) == [2]
    assert tokens(logits, params, outputs=[[1, 1]]) == [EOS]
    ignore = [SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)]
    assert tokens(logits, ignore, outputs=[[]]) == [EOS]


def test_thinking_budget_forces_end_token_in_random_rows() -> None:
    logits = torch.zeros(2, V)
    params = [SamplingParams(seed=4, thinking_token_budget=1, top_k=5)] * 2
    outputs = [[THINK_START, 1], [THINK_START]]
    assert tokens(logits, params, outputs=outputs)[0] == THINK_END
    n = 200
    free = tokens(
        torch.zeros(n, V), seeded(n, thinking_token_budget=1), outputs=[[THINK_START]] * n
    )
    assert set(free) != {THINK_END}


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_from_raw_logits_sampled_first() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=gen)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 50.0}),
        SamplingParams(seed=1, logprobs=1, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(seed=2),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = sample(logits, params, outputs=[[1], [2], [], []])
    lp = out.logprobs
    assert isinstance(lp, LogprobsOutput)
    assert lp.token_ids.shape == (4, 4) and lp.token_ids.dtype == torch.int64
    assert lp.logprobs.shape == (4, 4) and lp.logprobs.dtype == torch.float32
    assert lp.ranks.shape == (4,) and lp.ranks.dtype == torch.int64
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert sampled[0].item() == 0  # the bias decided the pick ...
    assert lp.token_ids[:, 0].tolist() == sampled.tolist()
    # ... but logprobs describe the raw logits.
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top = torch.topk(raw, 3, dim=-1)
    assert lp.token_ids[:, 1:].tolist() == top.indices.tolist()
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = [order[i].tolist().index(sampled[i].item()) + 1 for i in range(4)]
    assert lp.ranks.tolist() == expected_ranks
    assert lp.ranks[3].item() == 1  # greedy without processing picks the best token


def test_logprobs_zero_gives_only_sampled_token() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)], vocab_size=2)
    assert out.logprobs is not None
    assert out.logprobs.token_ids.tolist() == [[1]]
    assert out.logprobs.logprobs[0, 0].item() == pytest.approx(math.log(0.75))
    assert out.logprobs.ranks.tolist() == [1]


def test_metadata_skips_unused_stages() -> None:
    md = metadata_for([SamplingParams(temperature=0.0, top_k=3, seed=1)] * 2)
    assert md.all_greedy and not md.all_random
    assert md.temperature is None and md.top_k is None and md.seeds is None
    assert md.repetition_penalties is None and md.max_num_logprobs is None
    md = metadata_for([SamplingParams(seed=2**64 + 5), SamplingParams()], outputs=[[1, 2], []])
    assert md.all_random and md.seeds is not None and md.has_seed is not None
    assert md.seeds.tolist() == [5, 0] and md.has_seed.tolist() == [True, False]
    assert md.output_positions.tolist() == [2, 0]


def test_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [[0]], [], LogitsProcessors(), CPU)
    md = metadata_for([SamplingParams()])
    with pytest.raises(ValueError, match="num_rows=1"):
        Sampler()(torch.zeros(2, V), md)


def test_empty_batch() -> None:
    md = SamplingMetadata.build([], [], [], LogitsProcessors(), CPU)
    assert md.all_greedy and not md.all_random
    assert Sampler()(torch.zeros(0, V), md).sampled_token_ids.tolist() == []
