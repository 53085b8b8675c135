"""Speculative decoding without a model: n-gram drafts, who may speculate, the scheduler's
bookkeeping (drafts in the token budget, rejected drafts rolled back), the configuration."""

from __future__ import annotations

import pytest

from engine.arg_utils import EngineArgs
from engine.config import SpeculativeConfig
from engine.request import SamplingParams, StructuredOutputsParams
from engine.spec_decode.ngram import can_speculate, propose_ngram
from tests.unit.sched_utils import make_request, make_scheduler, sampled_output


def test_ngram_proposes_what_followed_the_most_recent_occurrence():
    a, b, c, d, e = 1, 2, 3, 4, 5
    assert propose_ngram([a, b, c, d, a, b], 3, 1, 2) == [c, d, a]
    # The longest recurring suffix wins over a more recent shorter one.
    assert propose_ngram([a, b, c, e, b, d, a, b], 2, 1, 2) == [c, e]
    # Among occurrences of the same n-gram, the most recent.
    assert propose_ngram([a, c, a, d, a], 1, 1, 1) == [d]
    # Near the end fewer drafts than asked; no recurrence, none.
    assert propose_ngram([a, b, c, a], 5, 1, 3) == [b, c, a]
    assert propose_ngram([a, b, c, d], 3, 1, 3) == []
    assert propose_ngram([a, b, a, b], 3, 3, 3) == []  # "b a b" never occurred before
    assert propose_ngram([a], 3, 1, 3) == [] and propose_ngram([a, a], 0, 1, 1) == []


def test_requests_whose_tokens_depend_only_on_logits_and_seed_speculate():
    assert can_speculate(SamplingParams(temperature=0.0))
    assert can_speculate(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1))
    for changed in (
        {"min_p": 0.1},
        {"logprobs": 2},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_tokens": 2},
        {"logit_bias": {3: 1.0}},
        {"extra_args": {"x": 1}},
        {"forced_output_token_ids": [7]},
        {"structured_outputs": StructuredOutputsParams(regex="[ab]+")},
    ):
        assert not can_speculate(SamplingParams(**{"temperature": 0.0, **changed})), changed
    # A disaggregated decode's forced first token: speculation once it is out.
    forced = SamplingParams(temperature=0.0, forced_output_token_ids=[7])
    assert not can_speculate(forced, 0) and can_speculate(forced, 1)


def test_speculative_config_is_checked():
    assert SpeculativeConfig().method == "ngram"
    assert SpeculativeConfig(method="draft_model", model="small").uses_draft_model
    with pytest.raises(ValueError, match="'draft_model' needs a draft 'model'"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="'model' is for method 'draft_model'"):
        SpeculativeConfig(method="ngram", model="small")
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(3\) must be <="):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    args = EngineArgs(model="tiny", speculative_config={"method": "ngram", "lookahead": 2})
    with pytest.raises(ValueError, match="lookahead"):
        args.create_engine_config()
    args = EngineArgs(model="tiny", speculative_config={"num_speculative_tokens": 2})
    config, _ = args.create_engine_config()
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=2)


def repeating_scheduler(**overrides):
    speculative = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    return make_scheduler(max_model_len=64, speculative=speculative, **overrides)


def test_drafts_are_scheduled_verified_and_rejected_ones_rolled_back():
    scheduler = repeating_scheduler()
    request = make_request("r", [5, 6, 7, 8, 5, 6], max_tokens=20, temperature=0.0)
    scheduler.add_request(request)
    so = scheduler.schedule()
    scheduler.update_from_output(so, sampled_output(so, {"r": [7]}))
    # "5 6 7" recurs: the drafts are what followed it.
    assert request.spec_token_ids == [8, 5, 6]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 4}  # the last token and three drafts
    assert so.scheduled_spec_decode_tokens == {"r": [8, 5, 6]}
    assert request.num_computed_tokens == 10  # all four computed, as far as the step knows
    # The model agreed with the first draft only: 8, then 9 where 5 was drafted.
    outputs = scheduler.update_from_output(so, sampled_output(so, {"r": [8, 9]}))
    assert outputs[0].new_token_ids == [8, 9]
    assert request.num_computed_tokens == 8  # 6 + 7 + 8 computed; 9 is the next input
    assert request.all_token_ids == [5, 6, 7, 8, 5, 6, 7, 8, 9]
    stats = scheduler.speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.mean_accepted_length == 2.0
    assert request.spec_token_ids == []  # "8 9" and "9" never occurred before


def test_drafts_respect_the_budget_max_tokens_and_preemption():
    scheduler = repeating_scheduler(max_num_batched_tokens=2)
    request = make_request("r", [1, 2, 1], max_tokens=3, temperature=0.0)
    scheduler.add_request(request)
    so = scheduler.schedule()
    so = _finish_prefill(scheduler, so, "r", 2)
    # max_tokens=3 with one output: at most one draft (the token verified last is free).
    assert request.spec_token_ids == [1]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 2}
    # A request with penalties never gets drafts.
    sampled = make_request("s", [1, 2, 1], max_tokens=5, temperature=1.0, presence_penalty=0.5)
    scheduler.add_request(sampled)
    scheduler.update_from_output(so, sampled_output(so, {"r": [1, 2]}))
    assert request.is_finished  # max_tokens reached exactly, not passed
    assert request.output_token_ids == [2, 1, 2]
    so = scheduler.schedule()
    so = _finish_prefill(scheduler, so, "s", 2)
    assert sampled.spec_token_ids == []  # "1 2 1 2" recurs, but s has a penalty
    # Preemption (by recompute) drops drafts with the KV they would have been verified on.
    sampled.spec_token_ids = [1, 2]
    scheduler.running.remove(sampled)
    scheduler.preemption.preempt(sampled)
    assert sampled.spec_token_ids == [] and sampled.num_computed_tokens == 0


def _finish_prefill(scheduler, so, req_id, token):
    while True:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        scheduler.update_from_output(so, sampled_output(so, {req_id: [token]} if done else {}))
        if done:
            return so
        so = scheduler.schedule()


def test_a_draft_model_gets_lookahead_slots_and_its_drafts_are_scheduled():
    """Method draft_model: the runner proposes, the scheduler keeps what fits (the context,
    max_tokens) and reserves k slots past each step for the draft's own K/V."""
    speculative = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=3)
    scheduler = make_scheduler(block_size=4, max_model_len=64, speculative=speculative)
    request = make_request("r", 8, max_tokens=5, temperature=0.0)
    penalized = make_request("p", 8, max_tokens=5, temperature=1.0, presence_penalty=0.5)
    scheduler.add_request(request)
    scheduler.add_request(penalized)
    so = scheduler.schedule()
    # 8 prompt tokens + 3 lookahead slots: three blocks for "r"; two for "p", which never
    # speculates.
    assert [len(r.block_ids) for r in so.scheduled_new_reqs] == [3, 2]
    output = sampled_output(so, {"r": [1], "p": [1]})
    output.draft_token_ids = {"r": [4, 5, 6], "p": [7]}
    scheduler.update_from_output(so, output)
    # One output of five: three drafts fit (the token verified last is free).
    assert request.spec_token_ids == [4, 5, 6] and penalized.spec_token_ids == []
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [4, 5, 6]}
    assert so.num_scheduled_tokens == {"r": 4, "p": 1}
    output = sampled_output(so, {"r": [4, 5, 9], "p": [2]})
    output.draft_token_ids = {"r": [1, 2, 3]}
    scheduler.update_from_output(so, output)
    assert request.output_token_ids == [1, 4, 5, 9]
    assert request.spec_token_ids == []  # max_tokens=5 with four outputs: no room for drafts
