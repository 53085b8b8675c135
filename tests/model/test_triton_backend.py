"""The Triton backend in a whole engine: greedy output equals the default backend's and
transformers' on the parity models, with every kernel of the path taken.

On this machine the kernels run in Triton's interpreter (tests/conftest.py), on the GPU
(`pytest --device cuda`) compiled; there `triton` is the default backend and the parity suite
runs it too.
"""

from __future__ import annotations

from collections import Counter

import pytest

from engine.layers.attention.triton import TritonBackend
from engine.layers.gpu import attention_kernels, fused_ops
from engine.layers.layer_ops import TritonLayerOps
from engine.llm import LLM
from tests.model.hf_models import ARCHITECTURES
from tests.model.test_parity import GREEDY, check_against_hf, make_llm, prompts

_KERNELS = (
    (attention_kernels, "decode_attention"),
    (attention_kernels, "prefill_attention"),
    (fused_ops, "rotary_kv_write"),
    (fused_ops, "add_rms_norm"),
    (fused_ops, "silu_mul"),
)


@pytest.fixture
def launches(monkeypatch) -> Counter:
    """How often each kernel's launcher ran (the path the test claims was taken)."""
    counts: Counter = Counter()
    for module, name in _KERNELS:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            if kwargs.get("new_kv") is not None:  # a decode-only step: K/V written in it
                counts["decode_attention writing its K/V"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


def greedy_tokens(llm: LLM, prompt_list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_list, GREEDY)]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_triton_backend_matches_default_and_hf(hf_refs, arch, launches):
    """Prefix hits on the second round, chunked prompts (a 16-token budget), mixed steps of
    prefills and decodes, a sliding window (mistral), per-head norms (qwen3)."""
    ref = hf_refs[arch]
    batch = prompts()[2:]  # 9 to 40 tokens: several blocks of 4, chunks of a 16-token budget
    default = greedy_tokens(make_llm(ref, max_num_batched_tokens=16), batch)
    llm = make_llm(ref, attention_backend="triton", max_num_batched_tokens=16)
    runner = llm.engine.runner
    assert isinstance(runner.attn_backend, TritonBackend)
    assert isinstance(runner.model.model.ops, TritonLayerOps)
    assert greedy_tokens(llm, batch) == default
    check_against_hf(ref, llm, batch)  # the second round hits the cached prefixes
    assert llm.engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert all(launches[name] > 0 for _, name in _KERNELS), launches
    assert launches["decode_attention writing its K/V"] > 0, launches
