"""Tensor parallelism: an engine split over ranks computes what one rank does.

Greedy output at tensor_parallel_size 2 equals transformers on every parity architecture, and
the top-20 logprobs of every generated token equal tensor_parallel_size 1's within 1e-4;
SmolLM2 at 3 ranks (9 query heads, 3 KV heads) likewise; KV heads replicate where there are
fewer than ranks; both collectives (shared memory, gloo) agree; a rank that dies ends the
engine's step with an error that names it, and a rank whose engine is gone exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from engine.llm import LLM
from engine.models.catalog import resolve_model
from engine.parallel.workers import TensorParallelError
from engine.request import SamplingParams
from tests.model.hf_models import ARCHITECTURES
from tests.model.test_parity import check_against_hf, make_llm, prompts
from tests.waiting import wait_until

TOP = 20
WITH_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP)


def _tokens_and_logprobs(llm: LLM, prompt_list: list[list[int]]) -> list[tuple[list, list]]:
    outputs = llm.generate(prompt_list, WITH_LOGPROBS)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_same_within(reference: list, sharded: list, tolerance: float = 1e-4) -> None:
    """Same tokens; at each step the same top ids, their logprobs within `tolerance`."""
    for (ref_tokens, ref_steps), (tokens, steps) in zip(reference, sharded, strict=True):
        assert tokens == ref_tokens
        for (ref_ids, ref_values, _), (ids, values, _) in zip(ref_steps, steps, strict=True):
            worst = max(abs(a - b) for a, b in zip(ref_values, values, strict=True))
            assert worst <= tolerance, f"logprobs differ by {worst}"
            # Ties within the tolerance may order differently; the sets must agree otherwise.
            assert ids[0] == ref_ids[0]
            assert len(set(ids) ^ set(ref_ids)) <= 2


def _logits_of(llm: LLM, prompt_list: list[list[int]]) -> list:
    """Every step's logits, as rank 0's sampler gets them (gathered over the ranks)."""
    model = llm.engine.runner.model
    seen: list = []
    compute = model.compute_logits

    def recording(hidden):
        logits = compute(hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = recording
    try:
        llm.generate(prompt_list, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        del model.compute_logits
    return seen


def assert_logits_within(reference: list, sharded: list, tolerance: float = 1e-4) -> None:
    assert len(reference) == len(sharded)  # the same steps: the same batches
    for ref, got in zip(reference, sharded, strict=True):
        assert ref.shape == got.shape
        assert float((ref - got).abs().max()) <= tolerance


def _sharded(llm: LLM, size: int) -> None:
    """The engine did split: followers run, and rank 0 holds 1/size of the q heads."""
    engine = llm.engine
    assert engine.followers is not None and engine.followers.size == size
    assert all(process.is_alive() for process in engine.followers._procs)
    model = engine.runner.model
    attn = model.model.layers[0].self_attn
    assert attn.num_heads * size == engine.arch.num_attention_heads
    if engine.runner.device.type == "cpu":  # shared-memory collectives: the fused step too
        assert model.fused_decode is not None


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tp2_matches_transformers_and_tp1(hf_refs, arch):
    ref = hf_refs[arch]
    one = make_llm(ref)
    single, single_logits = _tokens_and_logprobs(one, prompts()), _logits_of(one, prompts())
    one.close()
    llm = make_llm(ref, tensor_parallel_size=2)
    try:
        _sharded(llm, 2)
        check_against_hf(ref, llm, prompts())
        assert_same_within(single, _tokens_and_logprobs(llm, prompts()))
        assert_logits_within(single_logits, _logits_of(llm, prompts()))
    finally:
        llm.close()


def test_torch_attention_reads_its_heads_of_the_shared_cache(hf_refs):
    # The reference backend gathers slots by the cache's strides: a rank's view of its heads
    # of a cache of every head must read its own heads, not its neighbour's.
    ref = hf_refs["llama_gqa"]
    llm = make_llm(ref, tensor_parallel_size=2, attention_backend="torch")
    try:
        runner = llm.engine.runner
        assert runner.kv_cache.shape[4] == 2 and runner.kv_layers[0].shape[3] == 1
        assert type(runner.attn_backend).__name__ == "TorchReferenceBackend"
        check_against_hf(ref, llm, prompts())
    finally:
        llm.close()


def test_kv_heads_replicate_when_ranks_outnumber_them(hf_refs):
    # 4 q heads, 2 KV heads, 4 ranks: each rank one q head and the KV head it reads.
    ref = hf_refs["llama_gqa"]
    llm = make_llm(ref, tensor_parallel_size=4)
    try:
        _sharded(llm, 4)
        runner = llm.engine.runner
        assert runner.layout.num_kv_heads == 1 and runner.kv_cache_spec().num_kv_heads == 1
        check_against_hf(ref, llm, prompts()[:4])
    finally:
        llm.close()


def test_gloo_collectives_give_the_same_tokens(hf_refs):
    ref = hf_refs["qwen2_bias"]  # biases on q/k/v: each rank's slice of them
    single = _tokens_and_logprobs(make_llm(ref), prompts()[:4])
    llm = make_llm(ref, tensor_parallel_size=2, tensor_parallel_collectives="torch")
    try:
        assert type(llm.engine.followers.group).__name__ == "TorchGroup"
        assert llm.engine.runner.model.fused_decode is None  # it sums through shared memory
        assert_same_within(single, _tokens_and_logprobs(llm, prompts()[:4]))
    finally:
        llm.close()


def test_smollm2_at_three_ranks_matches_one(engine_device, float_weights):
    path = str(resolve_model("smollm2"))
    texts = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time")
    one = LLM(path, max_model_len=128, **engine_device, **float_weights)
    prompt_list = [one.tokenizer.encode(text) for text in texts]
    single, single_logits = _tokens_and_logprobs(one, prompt_list), _logits_of(one, prompt_list)
    one.close()
    three = LLM(path, max_model_len=128, tensor_parallel_size=3, **engine_device, **float_weights)
    try:
        _sharded(three, 3)
        assert three.engine.runner.layout.num_kv_heads == 1  # 3 KV heads over 3 ranks
        assert_same_within(single, _tokens_and_logprobs(three, prompt_list))
        assert_logits_within(single_logits, _logits_of(three, prompt_list))
    finally:
        three.close()


def test_a_rank_that_dies_fails_the_step_with_its_name(hf_refs):
    llm = make_llm(hf_refs["llama_gqa"], tensor_parallel_size=2)
    engine = llm.engine
    try:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        for i, prompt in enumerate(prompts()[:3]):
            engine.add_request(llm.inputs.make_request(f"r{i}", prompt, params))
        engine.step()
        engine.step()
        follower = engine.followers._procs[0]
        follower.kill()
        assert wait_until(lambda: not follower.is_alive(), 10)
        with pytest.raises(TensorParallelError, match="rank 1"):
            for _ in range(5):  # the step after the death, or the one after a pipe's buffer
                engine.step()
    finally:
        engine.close()


def test_a_rank_that_dies_while_the_engine_is_idle_is_reported(hf_refs):
    # No step fails (nothing runs); the watcher still learns of it: Serve's health check asks.
    llm = make_llm(hf_refs["llama_gqa"], tensor_parallel_size=2)
    try:
        assert llm.engine.tensor_parallel_failure() is None
        llm.engine.followers._procs[0].kill()
        assert wait_until(lambda: llm.engine.tensor_parallel_failure() is not None, 10)
        assert "rank 1 exited" in llm.engine.tensor_parallel_failure()
    finally:
        llm.close()


def test_a_rank_whose_engine_is_gone_exits(hf_refs, tmp_path):
    # The engine process is SIGKILLed: nothing closes its pipes politely, and its follower
    # must notice and exit, not linger holding cores and memory.
    pid_file = tmp_path / "follower.pid"
    script = textwrap.dedent(f"""
        import os, sys
        from engine.llm import LLM
        llm = LLM({hf_refs["llama_gqa"].path!r}, tensor_parallel_size=2, max_model_len=96,
                  device="cpu")
        with open({str(pid_file)!r} + ".tmp", "w") as f:
            f.write(str(llm.engine.followers._procs[0].pid))
        os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})  # whole, or not there
        sys.stdin.read()  # serves until killed
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    try:
        assert wait_until(lambda: pid_file.read_text().strip(), 120), "the engine did not start"
        follower = int(pid_file.read_text())
        engine.send_signal(signal.SIGKILL)
        engine.wait(30)
        assert wait_until(lambda: not _alive(follower), 30), "the follower outlived its engine"
    finally:
        engine.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped: its parent is gone, init reaps it) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def test_bench_tp_reports_both_engines_side_by_side():
    import torch

    from pdserve.bench.tp import TPBenchConfig, run

    threads = torch.get_num_threads()
    config = TPBenchConfig(model="tiny", output_len=4, batch_sizes=(1, 3), repeats=1)
    report = run(config)
    assert torch.get_num_threads() == threads  # the split engine's per-rank count undone
    assert report["collectives"] == "ShmGroup"
    for size in ("1", "3"):
        entry = report["batches"][size]
        assert entry["tp1_decode_tokens_per_s"] > 0 and entry["tp2_decode_tokens_per_s"] > 0
        ratio = entry["tp2_decode_tokens_per_s"] / entry["tp1_decode_tokens_per_s"]
        assert entry["tp2_to_tp1"] == pytest.approx(ratio, abs=2e-3)
        assert 0 < entry["collective_share"] < 1  # the split engine did exchange


def test_async_scheduling_speculation_and_grammars_at_two_ranks(hf_refs):
    # Every rank runs the same runner code: steps scheduled ahead, drafts verified, grammars
    # masking the logits (each rank compiles its own) give one rank's tokens.
    ref = hf_refs["llama_gqa"]
    # A draft model (another architecture, one vocabulary) runs whole on rank 0 alone.
    draft = {"method": "draft_model", "model": str(hf_refs["qwen2_bias"].path)}
    for extra in (
        {"async_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        {"speculative_config": {**draft, "num_speculative_tokens": 3}},
    ):
        llm = make_llm(ref, tensor_parallel_size=2, **extra)
        try:
            check_against_hf(ref, llm, prompts(2))
            if "speculative_config" in extra:  # drafts were verified, not only proposed
                assert llm.engine.refresh_stats().spec_decode.num_drafts > 0
        finally:
            llm.close()
    from engine.request import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=40,
        temperature=0.7,
        seed=9,
        structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
    )
    texts = ["Answer in JSON:", "Give me an object"]
    one = LLM("tiny", max_model_len=128)
    expected = [o.outputs[0].text for o in one.generate(texts, params)]
    one.close()
    two = LLM("tiny", max_model_len=128, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].text for o in two.generate(texts, params)] == expected
        assert all(text.startswith("{") for text in expected)  # the grammar held
    finally:
        two.close()
