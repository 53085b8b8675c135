"""Seeded sampling through the whole engine: same seed, same tokens, whatever the batch."""

from __future__ import annotations

from engine.llm import LLM
from engine.request import SamplingParams


def sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=12, seed=seed, ignore_eos=True, **kw
    )


PROMPT = [11, 22, 33, 44, 55]
OTHERS = [[1, 2, 3], [9] * 20, [100, 200]]


def make_llm(path: str, **kw) -> LLM:
    return LLM(path, max_model_len=96, block_size=4, num_gpu_blocks_override=300, **kw)


def test_same_seed_same_tokens_across_runs_and_batches(hf_refs):
    path = hf_refs["llama_gqa"].path
    alone = make_llm(path).generate([PROMPT], sampled(7))[0].outputs[0].token_ids
    # A fresh engine with another engine seed, the request in the middle of a mixed batch.
    llm = make_llm(path, seed=123)
    batch = [OTHERS[0], PROMPT, OTHERS[1], OTHERS[2]]
    params = [sampled(None), sampled(7), sampled(3), SamplingParams(temperature=0.0)]
    in_batch = llm.generate(batch, params)[1].outputs[0].token_ids
    assert in_batch == alone
    # Same request under chunked prefill and a tiny pool that preempts: still the same.
    tight = LLM(
        path,
        max_model_len=96,
        block_size=4,
        num_gpu_blocks_override=25,
        max_num_batched_tokens=8,
    )
    many = [PROMPT, *OTHERS, [5] * 30]
    outs = tight.generate(many, [sampled(7)] + [sampled(s) for s in range(1, 5)])
    assert outs[0].outputs[0].token_ids == alone


def test_different_seeds_differ_and_sampling_is_not_greedy(hf_refs):
    path = hf_refs["llama_gqa"].path
    llm = make_llm(path)
    outs = llm.generate([PROMPT] * 6, [sampled(s) for s in range(6)])
    distinct = {tuple(o.outputs[0].token_ids) for o in outs}
    assert len(distinct) >= 5
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))
    assert any(tokens != tuple(greedy[0].outputs[0].token_ids) for tokens in distinct)


def test_top_k_one_equals_greedy(hf_refs):
    ref = hf_refs["qwen2_bias"]
    llm = make_llm(ref.path)
    out = llm.generate([PROMPT], sampled(5, top_k=1))[0].outputs[0].token_ids
    assert out == ref.greedy(PROMPT, 12)
