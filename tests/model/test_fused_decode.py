"""The fused decode step (one C++ call per step) against the module path it replaces.

Every decode step of a generation runs both: the modules first (the reference: torch ops over
the blocked linears, writing the step's K/V), then the fused step over the same inputs and the
same cache; their hidden states must agree. The architectures cover GQA, llama3 rope scaling
with a tied head, qkv biases (Qwen2), per-head q/k norms (Qwen3) and a sliding window
(Mistral, window 8 < the contexts here).
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.attention import AttentionMetadata
from engine.layers.linear import BlockedLinear
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_fused import FusedDecodeStep
from engine.request import SamplingParams
from tests.model.hf_models import ARCHITECTURES
from tests.model.test_parity import check_against_hf, make_llm, prompts

# The CPU kernels split their work between threads: run them with two (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("two_threads")


class CheckedStep:
    """Stands in for the model's fused step: runs the modules, then the fused step, compares."""

    def __init__(self, model: LlamaForCausalLM, fused: FusedDecodeStep, backend) -> None:
        self.model, self.fused, self.backend = model, fused, backend
        self.steps = 0
        self.widest = 0

    def applies(self, metadata: AttentionMetadata) -> bool:
        return self.fused.applies(metadata)

    def __call__(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        self.model.fused_decode = None
        try:
            expected = self.model(input_ids, positions, kv_caches, metadata, self.backend)
        finally:
            self.model.fused_decode = self  # type: ignore[assignment]
        got = self.fused(input_ids, positions, kv_caches, metadata)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        self.steps += 1
        self.widest = max(self.widest, int(input_ids.shape[0]))
        return got


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_fused_step_matches_the_modules_every_step(hf_refs, arch):
    ref = hf_refs[arch]
    llm = make_llm(ref)
    runner = llm.engine.runner
    model = runner.model
    assert model.fused_decode is not None
    checked = CheckedStep(model, model.fused_decode, runner.attn_backend)
    model.fused_decode = checked  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    check_against_hf(ref, llm, prompts(6), params)  # and the tokens are still HF's
    assert checked.steps >= 11 and checked.widest == len(prompts(6))


def test_mixed_steps_take_the_modules(hf_refs):
    """A step with a prefill in it never reaches the fused step."""
    ref = hf_refs["llama_gqa"]
    llm = make_llm(ref, max_num_batched_tokens=16, long_prefill_token_threshold=5)
    fused = llm.engine.runner.model.fused_decode
    assert fused is not None
    seen: list[tuple[int, int]] = []
    original = fused.applies

    def spy(metadata: AttentionMetadata) -> bool:
        seen.append((metadata.num_tokens, metadata.num_decodes))
        return original(metadata)

    fused.applies = spy  # type: ignore[method-assign]
    check_against_hf(ref, llm, prompts(7))
    assert any(tokens > decodes for tokens, decodes in seen)  # chunks mixed with decodes
    assert any(tokens == decodes for tokens, decodes in seen)


def test_decoder_refuses_bad_weights_and_inputs(hf_refs):
    llm = make_llm(hf_refs["llama_gqa"])
    model = llm.engine.runner.model
    kernel = llm.engine.runner.attn_backend.kernel
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, BlockedLinear)
    good = [
        layer.input_layernorm.weight.detach(),
        qkv.packed,
        None,
        None,
        None,
        layer.self_attn.o_proj.packed,
        None,
        layer.post_attention_layernorm.weight.detach(),
        layer.mlp.gate_up_proj.packed,
        None,
        layer.mlp.down_proj.packed,
        None,
    ]
    config = model.config
    geometry = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.rms_norm_eps,
    )
    norm = model.model.norm.weight.detach()
    kernel.Decoder([good], norm, *geometry)  # the right tensors build
    swapped = list(good)
    swapped[1], swapped[5] = swapped[5], swapped[1]  # o where qkv belongs
    with pytest.raises(RuntimeError, match="wrong shape"):
        kernel.Decoder([swapped], norm, *geometry)
    with pytest.raises(RuntimeError, match="is required"):
        kernel.Decoder([[*good[:7], None, *good[8:]]], norm, *geometry)
    decoder = kernel.Decoder([good], norm, *geometry)
    hidden = torch.zeros(1, config.hidden_size)
    with pytest.raises(RuntimeError, match="one KV cache view per layer"):
        decoder.forward(
            hidden,
            torch.zeros(1, config.head_dim),
            torch.zeros(1, config.head_dim),
            [],
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            0,
            1.0,
        )
