"""Seeded sampling through the whole engine: same seed, same tokens, whatever the batch."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.request import Request, SamplingParams
from tests.model.conftest import HFReference


def sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=12, seed=seed, ignore_eos=True, **kw
    )


PROMPT = [11, 22, 33, 44, 55]
OTHERS = [[1, 2, 3], [9] * 20, [100, 200]]


def make_llm(ref: HFReference, **kw) -> LLM:
    args = dict(max_model_len=96, block_size=4, num_gpu_blocks_override=300)
    return LLM(ref.path, **{**args, **ref.engine_args, **kw})


def test_same_seed_same_tokens_across_runs_and_batches(hf_refs):
    ref = hf_refs["llama_gqa"]
    alone = make_llm(ref).generate([PROMPT], sampled(7))[0].outputs[0].token_ids
    # A fresh engine with another engine seed, the request in the middle of a mixed batch.
    llm = make_llm(ref, seed=123)
    batch = [OTHERS[0], PROMPT, OTHERS[1], OTHERS[2]]
    params = [sampled(None), sampled(7), sampled(3), SamplingParams(temperature=0.0)]
    in_batch = llm.generate(batch, params)[1].outputs[0].token_ids
    assert in_batch == alone
    # Same request under chunked prefill and a tiny pool that preempts: still the same.
    tight = make_llm(ref, num_gpu_blocks_override=25, max_num_batched_tokens=8)
    many = [PROMPT, *OTHERS, [5] * 30]
    outs = tight.generate(many, [sampled(7)] + [sampled(s) for s in range(1, 5)])
    assert outs[0].outputs[0].token_ids == alone


def test_different_seeds_differ_and_sampling_is_not_greedy(hf_refs):
    llm = make_llm(hf_refs["llama_gqa"])
    outs = llm.generate([PROMPT] * 6, [sampled(s) for s in range(6)])
    distinct = {tuple(o.outputs[0].token_ids) for o in outs}
    assert len(distinct) >= 5
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))
    assert any(tokens != tuple(greedy[0].outputs[0].token_ids) for tokens in distinct)


def test_top_k_one_equals_greedy(hf_refs):
    ref = hf_refs["qwen2_bias"]
    llm = make_llm(ref)
    out = llm.generate([PROMPT], sampled(5, top_k=1))[0].outputs[0].token_ids
    assert out == ref.greedy(PROMPT, 12)


def _resumed(llm: LLM, prompt: list[int], params: SamplingParams, outputs: list[int]):
    """A request created with `outputs` already produced (as if it came from a failed engine):
    the tokens and finish reason it adds."""
    llm.engine.add_request(Request("resumed", prompt, params, output_token_ids=outputs))
    tokens: list[int] = []
    finish = None
    while llm.engine.has_requests():
        for out in llm.engine.step().outputs:
            tokens += out.new_token_ids
            finish = out.finish_reason or finish
    return tokens, finish


def test_a_resumed_request_continues_draw_for_draw(hf_refs):
    """Greedy, seeded top-p, penalties, min_tokens and a stop token: a request resumed from
    its first k outputs on a fresh engine adds exactly the original's remaining tokens (what
    request migration relies on), and never sends the ones it was given."""
    ref = hf_refs["llama_gqa"]
    penalised = sampled(5, repetition_penalty=1.4, presence_penalty=0.5, min_tokens=10)
    cases = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), sampled(7)]
    cases.append(penalised)
    original = make_llm(ref).generate([PROMPT] * 3, cases)
    seeded_tokens = original[1].outputs[0].token_ids
    stopping = sampled(7, stop_token_ids=[seeded_tokens[8]])
    cases.append(stopping)
    original += make_llm(ref).generate([PROMPT], stopping)
    for params, out in zip(cases, original, strict=True):
        full = out.outputs[0].token_ids
        for k in (1, 5, len(full) - 1):
            tokens, finish = _resumed(make_llm(ref), PROMPT, params, full[:k])
            assert full[:k] + tokens == full, (params, k)
            assert finish == out.outputs[0].finish_reason


def test_resumed_outputs_are_checked(hf_refs):
    ref = hf_refs["llama_gqa"]
    llm = make_llm(ref)
    with pytest.raises(ValueError, match="already reach max_tokens=3"):
        Request("r", PROMPT, SamplingParams(max_tokens=3), output_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request(Request("r", PROMPT, sampled(1), output_token_ids=[1, 10**6]))
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    with pytest.raises(ValueError, match="fill max_model_len=96"):
        llm.engine.add_request(Request("r", PROMPT, long, output_token_ids=[3] * 91))
    assert not llm.engine.has_requests()
