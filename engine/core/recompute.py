"""Known output tokens computed again as decoding first computed them.

A request's output tokens can be known before this engine holds their KV: a preempted request
recomputes its own, a migrated one (`Request(output_token_ids=...)`) brings those an engine
that failed generated. Computed in one chunk with the prompt, their K/V come out of the
prefill's attention (SDPA over the chunk), not the decode kernel that computed them first: the
same values but for their last bits. With float32 linears that has never moved a token here.
Int8 activations (`linear_backend` "quantized", the CPU default on GGUF files) carry a last bit
across a quantization step: 5 of 16 SmolLM2 answers (its Q4_1 file, as shipped) resumed from
their first 4 to 24 tokens forked from the original.

So where the engine's linears quantize their activations (`SchedulerConfig.stepwise_recompute`),
a prompt's chunk stops at the prompt's end and each known output token is computed alone, one
per step, as decoding did (a one-token step attends as a decode, and samples nothing: the next
token is known). The last one's step samples the next token as decoding would have. A step
per token, slower than a chunk, for an answer that does not change. The prompt itself is
recomputed in a chunk: exact where it was first computed in one from its start too (a
migration to an engine that does not hold it); `batch_invariant` makes every case exact.
"""

from __future__ import annotations

from engine.request import Request


def stepwise_tokens(request: Request, num_computed: int, num_new_tokens: int) -> int:
    """`num_new_tokens` for `request` from `num_computed` on, so that the prompt's chunk ends
    at the prompt and known output tokens go one at a time."""
    if num_computed < request.num_prompt_tokens:
        return min(num_new_tokens, request.num_prompt_tokens - num_computed)
    if num_computed < len(request.all_token_ids) - 1:
        return min(num_new_tokens, 1)
    return num_new_tokens
