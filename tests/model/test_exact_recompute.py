"""Every token attends as a decode does where the linears quantize activations to int8
(engine/worker/step_inputs.py: plan_step, `token_by_token`).

On int8 activations (SmolLM2's Q4_1 file as shipped, `linear_backend` "quantized") a request
resumed from its first tokens — a migration — or preempted and recomputed computed them in a
chunk with the prompt, whose attention differs from the decodes' in the last bits, and forked
from the original at a near-tie (5 of 16 random prompts; 2 of 8 preempted batches' answers).
Now a chunk computes each token as a decode would, bit for bit."""

from __future__ import annotations

import random

import pytest

from engine.llm import LLM
from engine.models.catalog import resolve_model
from engine.request import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def smollm2(**kwargs) -> LLM:
    return LLM(str(resolve_model("smollm2")), device="cpu", max_model_len=192, **kwargs)


def random_prompts(llm: LLM, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = int(llm.engine.runner.arch.vocab_size)
    return [[rng.randrange(vocab) for _ in range(rng.choice([16, 40, 90]))] for _ in range(count)]


def resume(llm: LLM, prompt: list[int], given: list[int]) -> list[int]:
    """What a request resumed from `given` adds (computed with its prompt in one chunk)."""
    llm.engine.add_request(Request("resumed", prompt, GREEDY, output_token_ids=given))
    tokens: list[int] = []
    while llm.engine.has_requests():
        for out in llm.engine.step().outputs:
            tokens += out.new_token_ids
    return tokens


def test_a_resumed_request_on_int8_activations_continues_as_the_original():
    llm = smollm2(linear_backend="quantized", enable_prefix_caching=False)
    try:
        assert llm.engine.runner.model.attends_token_by_token
        for i, prompt in enumerate(random_prompts(llm, 8, seed=3)):
            original = list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)
            given = 4 + 8 * (i % 3)
            assert resume(llm, prompt, list(original[:given])) == list(original[given:]), i
    finally:
        llm.close()


def test_preempted_requests_on_int8_activations_answer_as_unpreempted():
    """A pool too small for the batch preempts (recompute mode): the answers are the ones a
    pool with room gives (their cached prompt blocks found again, the rest computed in a
    chunk that starts where the cache ends)."""
    roomy = smollm2(linear_backend="quantized")
    prompts = random_prompts(roomy, 8, seed=5)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    try:
        want = [list(o.outputs[0].token_ids) for o in roomy.generate(prompts, params)]
    finally:
        roomy.close()
    tight = smollm2(linear_backend="quantized", num_gpu_blocks_override=20)
    try:
        got = [list(o.outputs[0].token_ids) for o in tight.generate(prompts, params)]
        assert tight.engine.stats.num_preemptions > 0
    finally:
        tight.close()
    assert got == want


@pytest.mark.parametrize("backend", ["blocked", "quantized_float"])
def test_float_activations_keep_the_prefill_path(backend):
    """Float32 activations move only in their last bits: prefills keep SDPA's blocked kernel,
    and a resumed request's answer is the original's all the same."""
    llm = smollm2(linear_backend=backend, enable_prefix_caching=False)
    try:
        assert not llm.engine.runner.model.attends_token_by_token
        (prompt,) = random_prompts(llm, 1, seed=7)
        original = list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)
        assert resume(llm, prompt, list(original[:12])) == list(original[12:])
    finally:
        llm.close()
