"""Decode steps through the graph runner (engine/worker/cuda_graphs.py): static buffers,
batches padded to capture sizes, contexts padded to power-of-two blocks.

With `pytest --device cuda` the engines capture and replay real CUDA graphs (their default
there). On a CPU, where no graph can be captured, the same runner executes each pass eagerly
over the same static buffers, so the padding, bucketing and staging are checked here too."""

from __future__ import annotations

import pytest

from engine.layers.attention.cuda import CudaBackend
from engine.layers.attention.triton import TritonBackend
from engine.llm import LLM
from engine.request import SamplingParams
from engine.worker.cuda_graphs import capture_sizes, context_blocks
from tests.model.conftest import HFReference
from tests.model.test_parity import check_against_hf, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)


def gpu_style_llm(ref: HFReference, graphs: bool, attention: str = "cuda") -> LLM:
    """An engine as a GPU runs it: GPU attention (`cuda`: SDPA over gathered blocks; `triton`:
    the paged kernels, in the interpreter on a CPU), torch linears, and decode steps through
    the graph runner or (`graphs` False) eager. On a CPU the CPU's defaults (its decode
    kernel, fused decode step) are swapped for the GPU's, and graphs run eagerly."""
    args = dict(max_model_len=96, block_size=4, num_gpu_blocks_override=400, max_num_seqs=12)
    on_cpu = ref.engine_args["device"] == "cpu"
    cpu_args = {"linear_backend": "torch"} if on_cpu else {}
    if attention == "triton" or not on_cpu:
        cpu_args["attention_backend"] = attention
    llm = LLM(ref.path, **args, **ref.engine_args, **cpu_args, enforce_eager=not graphs)
    runner = llm.engine.runner
    if on_cpu:
        if attention == "cuda":
            runner.attn_backend = CudaBackend()
        if graphs:
            runner.graphs = runner.build_decode_graphs(runner.kv_layers)
    expected = TritonBackend if attention == "triton" else CudaBackend
    assert type(runner.attn_backend) is expected
    assert (runner.graphs is not None) == graphs
    return llm


def test_capture_sizes_and_context_buckets():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(10_000)[-1] == 256
    assert [context_blocks(n, 24) for n in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]


# Triton's kernels on the model with a sliding window (the others' under the interpreter would
# add a minute to the suite; tests/model/test_triton_backend.py runs every architecture).
@pytest.mark.parametrize(
    ("arch", "attention"),
    [("llama_gqa", "cuda"), ("qwen3_qk_norm", "cuda"), ("mistral", "cuda"), ("mistral", "triton")],
)
def test_graphed_decodes_match_hf(hf_refs, arch, attention):
    """Batches of 8 and 3 (padded to 4), contexts across several buckets, a sliding window
    (mistral), a second round over cached prefixes: HF's greedy tokens."""
    ref = hf_refs[arch]
    llm = gpu_style_llm(ref, graphs=True, attention=attention)
    check_against_hf(ref, llm, prompts(), GREEDY)
    check_against_hf(ref, llm, prompts()[:3], GREEDY)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    sizes = {size for size, _ in graphs._graphs}
    contexts = {blocks for _, blocks in graphs._graphs}
    assert {8, 4} <= sizes and {4, 8, 16} <= contexts
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


@pytest.mark.parametrize("attention", ["cuda", "triton"])
def test_graphed_sampling_equals_eager_draw_for_draw(hf_refs, attention):
    """Seeded sampling, penalties and logprobs read the graph's static logits: the same draws
    and logprob ranks as eager decoding, in a batch with greedy requests."""
    ref = hf_refs["llama_gqa"]
    penalised = SamplingParams(
        temperature=1.0, seed=3, repetition_penalty=1.3, max_tokens=20, logprobs=2
    )
    params = [SEEDED, GREEDY, penalised] * 2
    batch = prompts(5)[:6]

    def run(llm: LLM) -> list:
        outs = llm.generate(batch, params)
        return [
            (o.outputs[0].token_ids, [(ids, rank) for ids, _, rank in o.outputs[0].logprobs or []])
            for o in outs
        ]

    graphed = run(gpu_style_llm(ref, graphs=True, attention=attention))
    assert graphed == run(gpu_style_llm(ref, graphs=False, attention=attention))


def test_enforce_eager_must_be_a_bool(hf_refs):
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        LLM(hf_refs["llama_gqa"].path, max_model_len=32, enforce_eager="no")
