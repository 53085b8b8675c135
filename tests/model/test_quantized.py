"""Engines computing on a GGUF file's quantized blocks against the same file's float32 path
(`blocked`: dequantized at load, the oracle that equals transformers, tests/model/test_gguf.py).

`quantized_float` multiplies float32 activations by the blocks: the float path's tokens, every
type. `quantized` (what `auto` picks on CPUs) quantizes activations to int8 per block of 32,
as llama.cpp does: not the float path's bits, so SmolLM2's Q4_1 file is held to its float
path's perplexity within 1%, and the rest to what must hold whatever the rounding."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.layers.linear import BlockedLinear
from engine.layers.quantized import QUANT_TYPES, QuantEmbedding, QuantLinear
from engine.llm import LLM
from engine.models.catalog import resolve_model
from engine.request import SamplingParams
from engine.testing.gguf_writer import write_gguf
from pdserve.bench import perplexity as ppl
from tests.model.test_parity import GREEDY, prompts

pytestmark = pytest.mark.usefixtures("two_threads")

ENGINE_ARGS = dict(max_model_len=96, block_size=4, num_gpu_blocks_override=400, device="cpu")


def _on_blocks(llm: LLM) -> None:
    """Every linear, the embedding and the head compute on blocks; the fused decode step is on."""
    model = llm.engine.runner.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(linear, QuantLinear) and linear.weight_q is not None
            assert not hasattr(linear, "weight")  # no float copy of the matrix
    assert isinstance(model.lm_head, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    if model.config.tie_word_embeddings:  # one table for both
        assert model.lm_head.weight_q is model.model.embed_tokens.weight_q
    assert model.fused_decode is not None


def _greedy(llm: LLM, prompt_list, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


# The architectures the GGUF writer handles (not llama3 rope scaling, not mistral).
GGUF_ARCHITECTURES = ["llama_gqa", "qwen2_bias", "qwen3_qk_norm"]


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_float_activations_on_blocks_give_the_float_paths_tokens(
    hf_refs, tmp_path, arch, tensor_type
):
    ref = hf_refs[arch]
    path = str(write_gguf(Path(ref.path), tmp_path / f"{arch}.gguf", tensor_type))
    float_path = LLM(path, **ENGINE_ARGS, linear_backend="blocked")
    expected = _greedy(float_path, prompts())
    assert isinstance(float_path.engine.runner.model.model.layers[0].mlp.down_proj, BlockedLinear)
    float_path.close()
    llm = LLM(path, **ENGINE_ARGS, linear_backend="quantized_float")
    _on_blocks(llm)
    assert llm.engine.runner.model.lm_head.weight_q.float_activations
    assert _greedy(llm, prompts()) == expected
    llm.close()


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1"])
def test_four_bit_files_on_blocks_answer_alike_alone_and_in_a_batch(hf_refs, tmp_path, tensor_type):
    """4-bit random weights with int8 activations are too coarse for token equality with the
    float path (a rounding difference moves an activation across an int8 step). What must
    hold: the blocks are used, and a request's tokens do not depend on what it is batched
    with (each row is quantized and multiplied alone), which P/D and migration rely on."""
    ref = hf_refs["qwen2_bias"]  # biases on q/k/v: float parameters beside quantized weights
    path = str(write_gguf(Path(ref.path), tmp_path / "q.gguf", tensor_type))
    llm = LLM(path, **ENGINE_ARGS)  # auto: int8 activations on the blocks
    _on_blocks(llm)
    assert not llm.engine.runner.model.lm_head.weight_q.float_activations
    together = _greedy(llm, prompts()[:5])
    assert [_greedy(llm, [p])[0] for p in prompts()[:5]] == together
    llm.close()


@pytest.mark.parametrize(
    ("tensor_type", "backend", "oracle"),
    [("Q8_0", "quantized", "quantized"), ("Q4_1", "quantized_float", "blocked")],
)
def test_tensor_parallel_ranks_compute_on_their_slices_of_the_blocks(
    hf_refs, tmp_path, tensor_type, backend, oracle
):
    """Each rank keeps whole rows, or whole blocks of columns (o and down), on their blocks:
    int8 activations quantize the same blocks as at one rank; float activations give the
    float path's tokens."""
    ref = hf_refs["llama_gqa"]
    path = str(write_gguf(Path(ref.path), tmp_path / "m.gguf", tensor_type))
    one = LLM(path, **ENGINE_ARGS, linear_backend=oracle)
    single = _greedy(one, prompts()[:4])
    one.close()
    two = LLM(path, **ENGINE_ARGS, tensor_parallel_size=2, linear_backend=backend)
    try:
        _on_blocks(two)
        down = two.engine.runner.model.model.layers[0].mlp.down_proj
        assert down.in_features == 64  # half of the 128-wide MLP: whole blocks of columns
        assert _greedy(two, prompts()[:4]) == single
    finally:
        two.close()


def test_the_quantized_backend_refuses_what_it_cannot_do(hf_refs, tmp_path):
    ref = hf_refs["llama_gqa"]
    with pytest.raises(ValueError, match="need a GGUF checkpoint with matrices in Q4_0"):
        LLM(ref.path, **ENGINE_ARGS, linear_backend="quantized")
    f32 = str(write_gguf(Path(ref.path), tmp_path / "f32.gguf", "F32"))
    with pytest.raises(ValueError, match="has none this engine can keep"):
        LLM(f32, **ENGINE_ARGS, linear_backend="quantized")
    q8 = str(write_gguf(Path(ref.path), tmp_path / "q8.gguf", "Q8_0"))
    with pytest.raises(ValueError, match="needs a CPU device and dtype float32"):
        LLM(q8, **ENGINE_ARGS | {"dtype": "bfloat16"}, linear_backend="quantized")
    llm = LLM(f32, **ENGINE_ARGS)  # auto on an F32 file: the float path, no error
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj, BlockedLinear)
    llm.close()


def test_smollm2_on_its_q4_1_blocks_keeps_its_float_paths_perplexity():
    path = str(resolve_model("smollm2"))
    results = {}
    for backend in ("quantized", "blocked"):
        llm = LLM(path, device="cpu", linear_backend=backend, max_model_len=512)
        if backend == "quantized":
            _on_blocks(llm)
        windows = ppl.text_windows(llm, 256)[:4]  # ~1,000 tokens of the fixed English text
        results[backend] = ppl.perplexity(llm, windows)
        llm.close()
    assert results["quantized"] <= results["blocked"] * 1.01, results
    assert results["blocked"] < 40  # a real model reading English, not noise


def test_the_embedding_on_blocks_is_the_float_tables_rows(tmp_path, hf_refs):
    ref = hf_refs["qwen3_qk_norm"]  # tied: the head's table
    path = str(write_gguf(Path(ref.path), tmp_path / "t.gguf", "Q8_0"))
    on_blocks, on_floats = (
        LLM(path, **ENGINE_ARGS),
        LLM(path, **ENGINE_ARGS, linear_backend="torch"),
    )
    blocks = on_blocks.engine.runner.model.model.embed_tokens
    floats = on_floats.engine.runner.model.model
    ids = torch.tensor([[0, 5, 319], [7, 7, 1]])
    assert torch.equal(blocks(ids), floats.embed_tokens(ids))
    with pytest.raises(IndexError, match="outside the embedding table"):
        blocks(torch.tensor([320]))
    on_blocks.close()
    on_floats.close()


def test_seeded_sampling_on_blocks_is_reproducible(hf_refs, tmp_path):
    path = str(write_gguf(Path(hf_refs["llama_gqa"].path), tmp_path / "m.gguf", "Q4_1"))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    engines = [LLM(path, **ENGINE_ARGS) for _ in range(2)]
    first, second = (_greedy(llm, prompts()[:3], params) for llm in engines)
    assert first == second
    for llm in engines:
        llm.close()


@pytest.mark.parametrize("tensor_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_type_files_compute_on_their_blocks(tmp_path, tensor_type):
    """The tiny model (widths of whole 256-weight blocks) written with random K-type blocks
    (engine/testing/gguf_writer.py): float activations give the float path's tokens; int8
    activations run on the same blocks, a request's tokens independent of its batch."""
    path = str(write_gguf(resolve_model("tiny"), tmp_path / "k.gguf", tensor_type))
    args = {**ENGINE_ARGS, "max_model_len": 64}
    float_path = LLM(path, **args, linear_backend="blocked")
    expected = _greedy(float_path, prompts()[:4])
    float_path.close()
    exact = LLM(path, **args, linear_backend="quantized_float")
    _on_blocks(exact)
    types = exact.engine.runner.model.model.layers[0].mlp.down_proj.weight_q.types
    assert types == [QUANT_TYPES[tensor_type]]
    assert _greedy(exact, prompts()[:4]) == expected
    exact.close()
    int8 = LLM(path, **args)
    _on_blocks(int8)
    together = _greedy(int8, prompts()[:4])
    assert [_greedy(int8, [p])[0] for p in prompts()[:4]] == together
    int8.close()


def test_bench_latency_compares_backends_side_by_side_with_their_memory(tmp_path):
    from pdserve.bench.latency import LatencyBenchConfig, run

    path = str(write_gguf(resolve_model("tiny"), tmp_path / "t.gguf", "Q8_0"))
    config = LatencyBenchConfig(
        model=path,
        input_len=8,
        output_len=4,
        batch_sizes=(1, 2),
        repeats=2,
        device="cpu",
        linear_backends=("quantized", "blocked"),
        memory=True,
    )
    report = run(config)
    ours, theirs = report["engines"]["quantized"], report["engines"]["blocked"]
    assert ours["linear_backend"] == "quantized" and theirs["linear_backend"] == "blocked"
    assert ours["weight_bytes"] < theirs["weight_bytes"] / 2  # the blocks, not floats
    for size in ("1", "2"):
        mine, other = ours["batches"][size], theirs["batches"][size]
        ratio = mine["decode_tokens_per_s"] / other["decode_tokens_per_s"]
        assert mine["ratio_to_blocked"] == pytest.approx(ratio, rel=0.01)
    memory = report["memory"]
    for backend in ("quantized", "blocked"):
        entry = memory[backend]
        assert entry["kv_pool_mb"] == 64.0 and entry["file_mb"] > 0
        over = (entry["engine_mb"] - entry["kv_pool_mb"]) / entry["file_mb"]
        assert entry["engine_over_file"] == pytest.approx(over, rel=0.02)  # from rounded MBs
    # the float engine holds its dequantized copy, the quantized one does not
    assert memory["blocked"]["engine_mb"] > memory["quantized"]["engine_mb"]


def test_bench_perplexity_scores_the_same_tokens_on_each_backend(tmp_path):
    path = str(write_gguf(resolve_model("tiny"), tmp_path / "t.gguf", "Q8_0"))
    config = ppl.PerplexityBenchConfig(
        model=path, linear_backends=("quantized_float", "blocked"), window=64, greedy_tokens=8
    )
    report = ppl.run(config)
    assert report["tokens_scored"] > 100
    # float activations are the float path's bits: the same perplexity, the same greedy tokens
    assert report["perplexity"]["quantized_float"] == report["perplexity"]["blocked"]
    assert report["ratio_to_blocked"] == 1.0
    agreement = report["greedy_agreement_with_blocked"]
    assert agreement["agreement"] == 1.0 and agreement["identical"] == len(ppl.GREEDY_TEXTS)


def test_a_hand_off_on_blocks_continues_as_colocated(tmp_path):
    """The KV of a prompt token computed in a one-row step (a decode's attention) differs in
    its last bits from a prefill chunk's (SDPA), and int8 activations carried that into forks
    at near-ties (10 of 24 random prompts agreed before). The app's decode leg, the prefill
    engine's first token forced, takes the whole prompt's KV with that token and computes from
    the next position on, as colocated does: every answer is colocated's.
    Both engines in this process, over gRPC."""
    path = str(resolve_model("smollm2"))
    args = dict(device="cpu", max_model_len=128, linear_backend="quantized")
    kv = {"connector": "grpc", "secret": "s3cret"}
    prefill, decode = (
        LLM(path, kv_transfer_config=kv, **args),
        LLM(path, kv_transfer_config=kv, **args),
    )
    colocated = LLM(path, **args)
    rng = random.Random(1)
    vocab = int(decode.engine.runner.arch.vocab_size)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        for length in (16, 40, 100, 16, 40, 100, 16, 40):
            prompt = [rng.randrange(vocab) for _ in range(length)]
            (want,) = _greedy(colocated, [prompt], params)
            first = prefill.generate(
                [prompt], replace(params, max_tokens=1), {"do_remote_decode": True}
            )[0]
            leg = replace(params, forced_output_token_ids=first.outputs[0].token_ids)
            (out,) = decode.generate([prompt], leg, first.kv_transfer_params)
            assert list(out.outputs[0].token_ids) == want, length
            assert out.timing is not None and out.timing.kv_load_adopted_first_token
        stats = decode.engine.kv_transfer_stats()
        assert stats["blocks_verified"] == stats["blocks_requested"] > 0
    finally:
        for llm in (prefill, decode, colocated):
            llm.close()
