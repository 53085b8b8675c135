"""Tokens computed again as they were first computed.

On int8 activations (SmolLM2's Q4_1 file as shipped, `linear_backend` "quantized") a request
resumed from its first tokens — a migration — computed them in a chunk with the prompt, whose
attention (SDPA) differs from the decodes' in the last bits, and forked from the original at
near-ties (5 of 16 random prompts). Such engines now compute known output tokens one per step
(engine/core/recompute.py). `batch_invariant` goes further: every token attends as a decode,
so that preemption, prefix hits and chunking change nothing either."""

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


def resume(llm: LLM, prompt: list[int], given: list[int]) -> tuple[list[int], int]:
    """What a request resumed from `given` adds, and the engine steps before its first token."""
    llm.engine.add_request(Request("resumed", prompt, GREEDY, output_token_ids=given))
    tokens: list[int] = []
    steps_to_first = 0
    while llm.engine.has_requests():
        steps_to_first += not tokens
        for out in llm.engine.step().outputs:
            tokens += out.new_token_ids
    return tokens, steps_to_first


def greedy(llm: LLM, prompt: list[int]) -> list[int]:
    return list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)


def test_a_resumed_request_on_int8_activations_continues_as_the_original():
    llm = smollm2(linear_backend="quantized", enable_prefix_caching=False)
    try:
        assert llm.engine.scheduler.scheduler_config.stepwise_recompute
        for i, prompt in enumerate(random_prompts(llm, 8, seed=3)):
            original = greedy(llm, prompt)
            given = 4 + 8 * (i % 3)
            tokens, steps = resume(llm, prompt, original[:given])
            assert tokens == original[given:], (i, given)
            # The prompt in one chunk, then each given token alone, the last one sampling.
            assert steps == 1 + given
    finally:
        llm.close()


def test_batch_invariant_preempted_requests_answer_as_unpreempted():
    """A pool too small for the batch preempts (recompute mode; cached prompt blocks found
    again, the rest computed in a chunk that starts where the cache ends): with every token
    attending as a decode the answers are those a pool with room gives. Without it, 2 of
    these 8 forked."""
    prompts_of = random_prompts
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    roomy = smollm2(linear_backend="quantized", batch_invariant=True)
    try:
        assert roomy.engine.runner.model.attends_token_by_token
        prompts = prompts_of(roomy, 8, seed=5)
        want = [list(o.outputs[0].token_ids) for o in roomy.generate(prompts, params)]
    finally:
        roomy.close()
    tight = smollm2(linear_backend="quantized", batch_invariant=True, num_gpu_blocks_override=20)
    try:
        got = [list(o.outputs[0].token_ids) for o in tight.generate(prompts, params)]
        assert tight.engine.stats.num_preemptions > 0
    finally:
        tight.close()
    assert got == want


@pytest.mark.parametrize("backend", ["blocked", "quantized_float"])
def test_float_activations_keep_recomputing_in_one_chunk(backend):
    """Float32 activations move only in their last bits: the chunk stays (one step for prompt
    and given tokens together), and the answer is the original's."""
    llm = smollm2(linear_backend=backend, enable_prefix_caching=False)
    try:
        assert not llm.engine.scheduler.scheduler_config.stepwise_recompute
        assert not llm.engine.runner.model.attends_token_by_token
        (prompt,) = random_prompts(llm, 1, seed=7)
        original = greedy(llm, prompt)
        assert resume(llm, prompt, original[:12]) == (original[12:], 1)
    finally:
        llm.close()


def test_batch_invariant_needs_the_paged_cpu_kernel():
    """The torch backend's decodes gather every token's context: a prompt's chunk as decodes
    would take memory in its square."""
    with pytest.raises(ValueError, match="batch_invariant needs"):
        smollm2(batch_invariant=True, attention_backend="torch")
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        smollm2(batch_invariant="yes")
