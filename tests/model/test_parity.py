"""Greedy output equals Hugging Face transformers token for token (float32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.layers import cpu_kernels
from engine.layers.attention import TorchReferenceBackend
from engine.layers.attention.cpu import CpuBackend
from engine.layers.attention.cuda import CudaBackend
from engine.layers.attention.triton import TritonBackend
from engine.layers.linear import BF16Linear, BlockedLinear, PackedLinear
from engine.llm import LLM
from engine.request import SamplingParams
from engine.stats import scheduler_stats
from engine.worker.draft_model import DraftModelProposer
from tests.model.hf_models import ARCHITECTURES

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(seed: int = 0) -> list[list[int]]:
    """Different lengths, and two pairs sharing a prefix longer than several blocks."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 300) for _ in range(21)]
    out = [[rng.randrange(1, 300) for _ in range(n)] for n in (1, 3, 9, 17, 40)]
    out += [[*shared, 5, 6], [*shared, 7], [*shared[:13], 9, 9, 9]]
    return out


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling(request) -> dict:
    """Both step orders: async scheduling must give the same tokens."""
    return {"async_scheduling": request.param}


def make_llm(ref, **overrides) -> LLM:
    """The parity engine: small blocks, so every prompt spans several of them."""
    args = dict(max_model_len=96, block_size=4, num_gpu_blocks_override=400)
    return LLM(ref.path, **{**args, **ref.engine_args, **overrides})


def check_against_hf(ref, llm: LLM, prompt_list, params=GREEDY) -> None:
    outputs = llm.generate(prompt_list, params)
    for prompt, output in zip(prompt_list, outputs, strict=True):
        expected = ref.greedy(prompt, params.max_tokens)
        assert output.outputs[0].token_ids == expected, f"prompt {prompt}"


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batch_of_prompts_matches_hf(hf_refs, arch, prefix_caching, scheduling):
    ref = hf_refs[arch]
    llm = make_llm(ref, enable_prefix_caching=prefix_caching, **scheduling)
    model = llm.engine.runner.model
    if ref.engine_args["device"] == "cpu":  # the CPU defaults
        assert isinstance(llm.engine.runner.attn_backend, CpuBackend)
        assert isinstance(model.model.layers[0].mlp.down_proj, BlockedLinear)
        assert model.fused_decode is not None
    else:  # the GPU's: the Triton kernels, torch linears
        assert isinstance(llm.engine.runner.attn_backend, TritonBackend)
        assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    check_against_hf(ref, llm, prompts())
    # A second round reuses the cached prefixes of the first (when caching is on).
    check_against_hf(ref, llm, prompts())
    hits = llm.engine.scheduler.kv_cache_manager.prefix_cache_stats.hits
    assert (hits > 0) == prefix_caching


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qk_norm"])
def test_chunked_prefill_in_several_chunks_matches_hf(hf_refs, arch, scheduling):
    ref = hf_refs[arch]
    llm = make_llm(ref, max_num_batched_tokens=16, long_prefill_token_threshold=5, **scheduling)
    check_against_hf(ref, llm, prompts(1))


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias"])
def test_preemption_with_a_tiny_pool_matches_hf(hf_refs, arch, scheduling):
    ref = hf_refs[arch]
    # 26 usable blocks of 4 tokens: one 96-token sequence fits, the batch does not.
    llm = make_llm(ref, num_gpu_blocks_override=27, **scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    check_against_hf(ref, llm, prompts(2), params)
    assert scheduler_stats(llm.engine.scheduler).num_preemptions > 0


@pytest.mark.parametrize("arch", ["llama_gqa", "mistral"])
def test_torch_reference_backend_matches_hf(hf_refs, arch):
    """The oracle path (CPUs default to the C++ decode kernel and oneDNN-packed linears):
    plain torch attention and torch linears give the same tokens."""
    ref = hf_refs[arch]
    llm = make_llm(ref, attention_backend="torch", linear_backend="torch")
    assert type(llm.engine.runner.attn_backend) is TorchReferenceBackend
    model = llm.engine.runner.model
    assert not any(isinstance(m, (BlockedLinear, PackedLinear)) for m in model.modules())
    assert model.fused_decode is None
    check_against_hf(ref, llm, prompts(4))


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qk_norm"])
def test_onednn_linears_match_hf(hf_refs, arch):
    """The prefill deployment's linears (oneDNN-packed, a CPU backend): same tokens, no fused
    step."""
    ref = hf_refs[arch]
    llm = make_llm(ref, linear_backend="onednn", device="cpu")
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
    assert model.fused_decode is None
    check_against_hf(ref, llm, prompts(5))


@pytest.mark.skipif(
    "avx512_bf16" not in cpu_kernels._cpu_flags().split(),
    reason="needs AVX-512 BF16 (the CI machine has it)",
)
@pytest.mark.parametrize("arch", ["llama3_rope_tied", "qwen2_bias"])
def test_bfloat16_engines_pack_their_linears_and_answer_as_torchs_do(hf_refs, arch):
    """dtype bfloat16 on a CPU with AVX-512 BF16 (this one): every linear, the tied head
    with its embedding, computes with vdpbf16ps (BF16Linear); the tokens are those of the same
    engine on torch's bfloat16 linears (bfloat16 is not float32: transformers' float32
    tokens are not the oracle here)."""
    ref = hf_refs[arch]
    args = {**ref.engine_args, "device": "cpu", "dtype": "bfloat16"}
    torch_linears = make_llm(ref, **args, linear_backend="torch")
    expected = [o.outputs[0].token_ids for o in torch_linears.generate(prompts(), GREEDY)]
    llm = make_llm(ref, **args)
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, BF16Linear)
    assert isinstance(model.lm_head, BF16Linear)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)] == expected


def test_batched_prefill_backend_matches_hf(hf_refs):
    """The GPU fast path's algorithm, run on CPU (no CUDA here): same tokens."""
    ref = hf_refs["llama_gqa"]
    llm = make_llm(ref)
    llm.engine.runner.attn_backend = CudaBackend()
    check_against_hf(ref, llm, prompts(3))


def test_prompt_of_exactly_one_block_and_block_boundaries(hf_refs):
    ref = hf_refs["llama_gqa"]
    llm = LLM(
        ref.path, max_model_len=64, block_size=8, num_gpu_blocks_override=64, **ref.engine_args
    )
    boundary = [[(i * 7) % 300 + 1 for i in range(n)] for n in (7, 8, 9, 16)]
    check_against_hf(ref, llm, boundary)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_ngram_speculation_matches_hf(hf_refs, arch, scheduling):
    """Drafts verified against the argmax: the same greedy tokens as HF, with drafts accepted
    (random tiny models loop, and the prompts repeat themselves)."""
    ref = hf_refs[arch]
    llm = make_llm(ref, speculative_config=NGRAM, **scheduling)
    repeating = [p * 2 for p in prompts(8)[:4]] + prompts(8)[4:]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    check_against_hf(ref, llm, repeating, params)
    stats = llm.engine.scheduler.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert llm.engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 399


def test_ngram_speculation_leaves_sampled_and_stopping_requests_as_they_were(hf_refs):
    """Seeded sampled requests beside speculating greedy ones, stop tokens inside accepted
    runs, max_tokens mid-run: every output equals the run without speculation."""
    ref = hf_refs["llama_gqa"]
    batch = [p * 2 for p in prompts(9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=17, ignore_eos=True)
    plain = make_llm(ref).generate(batch, [greedy, seeded] * 4)
    stops = {t for out in plain[::2] for t in out.outputs[0].token_ids[5:9]}
    stopping = SamplingParams(temperature=0.0, max_tokens=17, stop_token_ids=sorted(stops)[:2])
    plain += make_llm(ref).generate(batch[:2], stopping)
    llm = make_llm(ref, speculative_config=NGRAM)
    fast = llm.generate(batch, [greedy, seeded] * 4) + llm.generate(batch[:2], stopping)
    for a, b in zip(plain, fast, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert llm.engine.scheduler.speculator.stats.num_accepted_tokens > 0


def test_ngram_speculation_with_sampling_follows_the_target_distribution(hf_refs):
    """Unseeded sampling (temperature 3 over the top 3) with n-gram drafts: the joint
    frequencies of the first three output tokens (the third sampled at a drafted position when
    the second matched its draft) stay within a small total-variation distance of the model's
    exact distribution; drafts were both accepted and rejected. Argmax at drafted positions,
    or a draft kept without being sampled, moves the distance far past the bound."""
    ref = hf_refs["llama_gqa"]
    temperature, top_k, samples = 3.0, 3, 3000

    def top_probs(tokens: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = ref.model(torch.tensor([tokens])).logits[0, -1] / temperature
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    # The model's own greedy loop as the prompt: its likely continuations recur in it, so the
    # drafts are often among the tokens it may sample.
    seed_prompt = [11, 12, 13, 14]
    prompt = seed_prompt + ref.greedy(seed_prompt, 40)
    expected: dict[tuple[int, ...], float] = {}
    for a, pa in top_probs(prompt).items():
        for b, pb in top_probs([*prompt, a]).items():
            for c, pc in top_probs([*prompt, a, b]).items():
                expected[(a, b, c)] = pa * pb * pc
    llm = make_llm(ref, speculative_config=NGRAM, max_num_seqs=128)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3)
    counts: dict[tuple[int, ...], int] = {}
    for out in llm.generate([prompt] * samples, params):
        triple = tuple(out.outputs[0].token_ids)
        counts[triple] = counts.get(triple, 0) + 1
    assert set(counts) <= set(expected)
    distance = 0.5 * sum(abs(counts.get(k, 0) / samples - p) for k, p in expected.items())
    assert distance < 0.08
    stats = llm.engine.scheduler.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qk_norm", "llama3_rope_tied"])
def test_a_model_drafting_for_itself_is_accepted_and_matches_hf(
    hf_refs, arch, scheduling, monkeypatch
):
    """The target as its own draft model: its greedy drafts are the target's greedy tokens, so
    nearly all are accepted — unless the draft K/V bookkeeping (catch-up, lookahead slots,
    rejected drafts recomputed, preemption) is wrong. Output: HF's greedy tokens. The draft's
    passes stay within the token budget (prompts longer than it are caught up over steps)."""
    passes = []
    forward = DraftModelProposer._forward

    def counted(self, batch, rows, starts, counts):
        passes.append(int(counts.sum()))
        return forward(self, batch, rows, starts, counts)

    monkeypatch.setattr(DraftModelProposer, "_forward", counted)
    ref = hf_refs[arch]
    spec = {"method": "draft_model", "model": str(ref.path), "num_speculative_tokens": 3}
    # A pool that preempts, chunked prompts, and a second round over cached prefixes.
    llm = make_llm(
        ref, speculative_config=spec, num_gpu_blocks_override=40, max_num_batched_tokens=24
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    check_against_hf(ref, llm, prompts(6), params)
    check_against_hf(ref, llm, prompts(6), params)
    stats = llm.engine.scheduler.speculator.stats
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate > 0.9
    assert scheduler_stats(llm.engine.scheduler).num_preemptions > 0
    assert llm.engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 39
    assert max(passes) == 24  # the budget, reached by a catch-up (prompts go up to 40)


def test_another_model_as_draft_leaves_greedy_and_seeded_outputs_as_they_were(hf_refs):
    """A draft of another architecture sharing the vocabulary: drafts accepted and rejected,
    greedy output HF's, seeded sampling draw for draw plain decoding's."""
    ref = hf_refs["llama_gqa"]
    draft = hf_refs["qwen2_bias"].path
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    llm = make_llm(ref, speculative_config=spec)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    check_against_hf(ref, llm, prompts(7), greedy)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    plain = make_llm(ref).generate(prompts(7), seeded)
    drafted = llm.generate(prompts(7), seeded)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.scheduler.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_model_must_share_the_vocabulary_and_attend_to_everything(hf_refs):
    spec = {"method": "draft_model", "model": "tiny"}  # another tokenizer
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        make_llm(hf_refs["llama_gqa"], speculative_config=spec)
    windowed = {"method": "draft_model", "model": str(hf_refs["mistral"].path)}
    with pytest.raises(ValueError, match="does not support sliding-window models"):
        make_llm(hf_refs["llama_gqa"], speculative_config=windowed)
