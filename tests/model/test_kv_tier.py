"""The KV tier through the whole engine: prefixes evicted from the primary pool come back from
host memory or a file, token-exact with transformers; a corrupted tier read is caught and
recomputed; a preempted request swaps its KV out and back; no block is held afterwards."""

from __future__ import annotations

import random

import pytest
import torch

from deployments.cluster.prefix_index import PrefixIndex
from engine.llm import LLM
from engine.request import SamplingParams
from tests.model.conftest import HFReference

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine(ref: HFReference, blocks: int, **args) -> LLM:
    return LLM(
        ref.path,
        max_model_len=96,
        block_size=4,
        num_gpu_blocks_override=blocks,
        **{**ref.engine_args, **args},
    )


def conversations(seed: int, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 300) for _ in range(24)] for _ in range(count)]


def converse(llm: LLM, first: list[list[int]], turns: int, seed: int) -> list[list[list[int]]]:
    """Turns round robin, one conversation at a time: the pool (30 blocks) holds about one,
    so each conversation's prefix is evicted before its next turn."""
    rng = random.Random(seed)
    contexts = [list(c) for c in first]
    answers: list[list[list[int]]] = [[] for _ in first]
    for _ in range(turns):
        for i, context in enumerate(contexts):
            [out] = llm.generate([{"prompt_token_ids": context}], GREEDY)
            tokens = list(out.outputs[0].token_ids)
            answers[i].append(tokens)
            context += tokens + [rng.randrange(1, 300) for _ in range(8)]
    assert llm.drain()
    return answers


def expected_answers(ref: HFReference, first, turns: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    contexts = [list(c) for c in first]
    answers: list[list[list[int]]] = [[] for _ in first]
    for _ in range(turns):
        for i, context in enumerate(contexts):
            tokens = ref.greedy(context, GREEDY.max_tokens)
            answers[i].append(tokens)
            context += tokens + [rng.randrange(1, 300) for _ in range(8)]
    return answers


def assert_nothing_held(llm: LLM) -> None:
    """Once the engine has stepped until nothing is pending (the tier's stores hold their
    blocks until a step hears they are done), every block is free."""
    assert llm.drain()
    manager = llm.engine.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    assert not llm.engine.has_requests()


# Host memory, a file, and host memory too small for the conversations (15 slots) over a
# file (1,048): a third tier, what host memory evicts moves down and comes back from there.
TIERS = {
    "cpu": {"kv_offloading_size": 0.002},
    "disk": {"kv_offloading_size": 0.002, "kv_offloading_backend": "disk"},
    "cpu+disk": {"kv_offloading_size": 0.00003, "kv_offloading_disk_size": 0.002},
}


@pytest.mark.parametrize("backend", list(TIERS))
def test_evicted_prefixes_come_back_from_the_tier_token_exact(hf_refs, backend, tmp_path):
    ref = hf_refs["llama_gqa"]
    path = {"kv_offloading_path": str(tmp_path)} if "disk" in backend else {}
    llm = engine(ref, 31, step_trace_size=4096, **TIERS[backend], **path)
    first = conversations(1)
    answers = converse(llm, first, turns=3, seed=2)
    assert answers == expected_answers(ref, first, 3, 2)
    stats = llm.engine.stats
    tier = stats.kv_tier
    # Every later turn found its conversation's earlier turns in the tier, not the pool.
    assert tier["loaded"] > 0 and tier["hit_tokens"] >= 8 * 24 and tier["failed"] == 0
    assert tier["loaded"] * 4 == tier["hit_tokens"]
    if backend == "cpu+disk":  # host memory's evictions went down and came back up
        assert tier["demoted"] > 0 and tier["lower_hit_tokens"] > 0
    records = llm.engine.scheduler.step_trace.records()
    assert any(r["tiers"][backend.split("+")[-1]]["cached"] > 0 for r in records)
    assert any(r["loaded"] for r in records)  # requests admitted once their tier load ended
    assert_nothing_held(llm)
    llm.close()


# One cache; and ranks with a cache each, the bit flipped in the second rank's part of a slot.
PER_RANK = {"tensor_parallel_size": 2, "tensor_parallel_kv_cache": "per_rank"}


@pytest.mark.parametrize(("args", "part"), [({}, 0), (PER_RANK, 1)], ids=["one", "per_rank"])
def test_a_corrupted_tier_read_is_caught_and_recomputed(hf_refs, args, part):
    ref = hf_refs["llama_gqa"]
    llm = engine(ref, 31, kv_offloading_size=0.002, **args)
    first = conversations(3, count=2)
    rng = random.Random(4)
    contexts = [c + [rng.randrange(1, 300) for _ in range(8)] for c in first]
    llm.generate([{"prompt_token_ids": c} for c in first], GREEDY)
    evict_pool(llm)  # the first turns' blocks are in the tier only
    worker, tier = llm.engine.runner.tier, llm.engine.scheduler.tier
    for slot in range(tier.num_used_slots):  # one flipped bit in every block it holds
        worker.corrupt_slot(slot, part)
    outs = llm.generate([{"prompt_token_ids": c} for c in contexts], GREEDY)
    assert llm.drain()
    assert [list(o.outputs[0].token_ids) for o in outs] == [ref.greedy(c, 6) for c in contexts]
    stats = llm.engine.stats.kv_tier
    assert stats["hit_tokens"] > 0 and stats["failed"] > 0  # found, caught, never used
    assert stats["loaded"] == 0
    assert_nothing_held(llm)
    llm.close()


def evict_pool(llm: LLM) -> None:
    """Fill the pool with unrelated prompts, so the next turns find nothing there."""
    rng = random.Random(99)
    for _ in range(2):  # one after the other: each takes the pool's least recent blocks
        llm.generate([{"prompt_token_ids": [rng.randrange(1, 300) for _ in range(80)]}], GREEDY)
    assert llm.drain()


def test_preempted_requests_swap_their_kv_to_the_tier_and_back_with_the_same_tokens(hf_refs):
    ref = hf_refs["llama_gqa"]
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True),
    ] * 3
    results = {}
    for name, args in (("recompute", {}), ("swap", {"kv_offloading_size": 0.002})):
        llm = engine(ref, 40, **args)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.drain()
        results[name] = [list(o.outputs[0].token_ids) for o in outs]
        stats = llm.engine.stats
        assert stats.num_preemptions > 0, name  # the pool fits about two of them at once
        if name == "swap":
            assert stats.kv_tier["swap_preemptions"] > 0  # measured: copying is cheaper here
            assert stats.kv_tier["swapped_in"] > 0  # their own KV came back, not recomputed
        assert_nothing_held(llm)
        llm.close()
    assert results["swap"] == results["recompute"]
    for prompt, param, tokens in zip(prompts, params, results["swap"], strict=True):
        if param.temperature == 0.0:
            assert tokens == ref.greedy(prompt, 40)


def test_an_index_fed_the_engines_events_finds_what_only_the_tier_holds(hf_refs):
    ref = hf_refs["llama_gqa"]
    events = {"enable_kv_cache_events": True}
    llm = engine(ref, 31, kv_offloading_size=0.002, kv_events_config=events)
    [prompt] = conversations(8, count=1)
    llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    evict_pool(llm)
    manager = llm.engine.scheduler.kv_cache_manager
    request = llm.inputs.make_request("probe", prompt, GREEDY)
    request.set_block_hasher(manager.block_hasher, manager.block_size)
    hashes = request.block_hashes
    assert all(manager.block_pool.get_cached_block(h) is None for h in hashes)  # pool: gone
    index, stream = PrefixIndex(), llm.engine.kv_events
    while (batch := stream.take_batch()) is not None:
        assert index.apply("engine", batch)
    assert index.match(hashes) == {"engine": len(hashes)}  # the tier holds every block
    # ... and only the tier: routing credits those blocks below a pool's (kv_scoring).
    assert index.tier_only_blocks("engine", hashes) == len(hashes)
    recovered = PrefixIndex()  # an index that restarted: the snapshot says as much
    recovered.load_snapshot("engine", stream.snapshot())
    assert recovered.match(hashes) == {"engine": len(hashes)}
    assert recovered.tier_only_blocks("engine", hashes) == len(hashes)
    llm.close()


def test_a_prefix_loan_lends_the_tier_s_blocks_loaded_back_and_verified(hf_refs):
    """A prefix evicted from the pool but kept by the tier is lent all the same: its blocks
    are copied back into fresh pool blocks, bit for bit the KV the prompt left, before the
    loan is answered; a block that does not verify ends the lent run there."""
    ref = hf_refs["llama_gqa"]
    llm = engine(ref, 31, kv_offloading_size=0.002)
    [prompt] = conversations(11, count=1)
    llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    manager = llm.engine.scheduler.kv_cache_manager
    request = llm.inputs.make_request("probe", prompt, GREEDY)
    request.set_block_hasher(manager.block_hasher, manager.block_size)
    hashes = request.block_hashes
    cache = llm.engine.runner.kv_cache
    left = [cache[manager.block_pool.get_cached_block(h).block_id].clone() for h in hashes]
    evict_pool(llm)
    assert all(manager.block_pool.get_cached_block(h) is None for h in hashes)
    lent = llm.engine.pin_prefix(hashes, "loan-1")
    worker, tier = llm.engine.runner.tier, llm.engine.scheduler.tier
    assert len(lent) == len(hashes) and tier.stats.lent == len(hashes)
    assert all(torch.equal(cache[block_id], kv) for block_id, kv in zip(lent, left, strict=True))
    assert manager.return_loan("loan-1")
    [bad_slot] = tier.match(hashes, 2, 1)  # the prompt's third block, at rest in the tier
    worker.corrupt_slot(bad_slot)
    assert len(llm.engine.pin_prefix(hashes, "loan-2")) == 2  # the run ends before it
    assert tier.stats.failed == 1 and not tier.holds(hashes[2])
    assert manager.return_loan("loan-2")
    assert_nothing_held(llm)
    llm.close()


@pytest.mark.parametrize("kv_cache", ["auto", "per_rank"])
def test_swap_under_tensor_parallelism_is_made_before_any_rank_writes(hf_refs, kv_cache):
    """auto: the ranks share one cache of every head, so a preempted request's blocks must be
    in the tier before the step goes to the other ranks, which may reuse them at once.
    per_rank (what GPUs have, host memory standing in for each rank's device): a slot holds
    a block of every rank's cache, which rank 0 maps, each part summed."""
    ref = hf_refs["llama_gqa"]
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    args = dict(tensor_parallel_size=2, tensor_parallel_kv_cache=kv_cache)
    llm = engine(ref, 40, kv_offloading_size=0.002, **args)
    try:
        runner = llm.engine.runner  # (on GPUs "auto" keeps a cache per rank too)
        parts = 1 if runner.shares_kv_cache else 2
        assert runner.tier.slot_bytes == parts * runner.kv_cache[0].nbytes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        assert [list(o.outputs[0].token_ids) for o in outs] == [ref.greedy(p, 40) for p in prompts]
        tier = llm.engine.stats.kv_tier
        assert tier["swap_preemptions"] > 0 and tier["swapped_in"] > 0 and tier["failed"] == 0
        assert_nothing_held(llm)
    finally:
        llm.close()
