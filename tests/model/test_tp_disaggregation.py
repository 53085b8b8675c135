"""Prefill and decode engines of different tensor-parallel sizes, both directions, over NIXL
and gRPC: the decode engine's output equals one colocated single-rank engine's, greedy and
seeded, and its KV came over the transport (blocks read, checksums verified), not recomputed.

The ranks of an engine on one CPU host share one KV cache of every head by default (each
attends over its own), so what the connector registers and moves is whole blocks of every
head, whatever either side's size. With tensor_parallel_kv_cache="per_rank" each rank keeps
its own heads' cache, as ranks on GPUs do (a GPU cannot be had here: host memory stands in for
each rank's device memory): rank 0 registers every rank's cache as a shard, and a read maps
heads between the two engines' shards (connector/kv_shards.py) — straight into place where
the heads match, through staging where they do not."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from tests.model.test_parity import prompts

ARGS = dict(max_model_len=96, block_size=4, num_gpu_blocks_override=200, device="cpu")
PARAMS = (
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
)


@pytest.fixture(scope="module")
def colocated(hf_refs) -> Iterator[LLM]:
    llm = LLM(hf_refs["qwen2_bias"].path, **ARGS)  # one rank: the oracle
    yield llm
    llm.close()


def _engines(
    path: str, transport: str, prefill_tp: int, decode_tp: int, kv_cache: str = "auto"
) -> tuple[LLM, LLM]:
    kv = {"connector": transport, "secret": secrets.token_hex(16)}
    split = dict(tensor_parallel_kv_cache=kv_cache, kv_transfer_config=kv, **ARGS)
    prefill = LLM(path, tensor_parallel_size=prefill_tp, **split)
    decode = LLM(path, tensor_parallel_size=decode_tp, **split)
    return prefill, decode


@pytest.mark.parametrize(
    ("transport", "prefill_tp", "decode_tp", "kv_cache"),
    [
        ("nixl", 2, 1, "auto"),
        ("nixl", 1, 2, "auto"),
        ("grpc", 2, 1, "auto"),
        ("grpc", 1, 2, "auto"),
        ("nixl", 2, 2, "auto"),
        # A cache per rank (GPUs' layout): heads staged between sizes, direct at equal ones.
        ("nixl", 2, 1, "per_rank"),
        ("nixl", 1, 2, "per_rank"),
        ("grpc", 2, 1, "per_rank"),
        ("grpc", 1, 2, "per_rank"),
        ("nixl", 2, 2, "per_rank"),
        # 4 ranks over 2 KV heads replicate each (a cache per rank, whatever is asked).
        ("nixl", 4, 1, "auto"),
        ("grpc", 1, 4, "auto"),
    ],
)
def test_handoff_between_tensor_parallel_sizes_equals_colocated(
    hf_refs, colocated, transport, prefill_tp, decode_tp, kv_cache
):
    path = hf_refs["qwen2_bias"].path
    prefill, decode = _engines(path, transport, prefill_tp, decode_tp, kv_cache)
    try:
        for llm, size in ((prefill, prefill_tp), (decode, decode_tp)):
            runner = llm.engine.runner
            assert runner.group.size == size
            heads = llm.engine.arch.num_key_value_heads
            shards = runner.kv_shards  # every head, in one cache or in one per rank
            held = [h for s in shards for h in range(s.first_head, s.first_head + s.num_heads)]
            assert sorted(set(held)) == list(range(heads))
            per_rank = kv_cache == "per_rank" or heads % size  # replicated heads: per rank
            assert len(shards) == (size if per_rank else 1)
        texts = prompts()[3:7]  # 17 to 40 tokens: several blocks each
        for params in PARAMS:
            expected = [o.outputs[0].token_ids for o in colocated.generate(texts, params)]
            before = dict(decode.engine.refresh_stats().kv_transfer)
            handed = prefill.generate(
                texts, SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True}
            )
            outputs = [
                decode.generate([text], params, h.kv_transfer_params)[0]
                for text, h in zip(texts, handed, strict=True)
            ]
            after = dict(decode.engine.refresh_stats().kv_transfer)
            assert [o.outputs[0].token_ids for o in outputs] == expected
            # Every block the decode engine's own cache lacked was read (none recomputed).
            read = after.get("blocks_read", 0) - before.get("blocks_read", 0)
            assert read > 0
            assert read == after["blocks_requested"] - before.get("blocks_requested", 0)
            assert after.get("reads_failed", 0) == before.get("reads_failed", 0)
            assert after.get("checksum_failures", 0) == before.get("checksum_failures", 0)
            assert after["blocks_verified"] - before.get("blocks_verified", 0) == read
            # The pieces each read was made of: straight into place where both engines'
            # shards hold the same heads, staged where not.
            staged = after["pieces_staged"] - before.get("pieces_staged", 0)
            direct = after["pieces_direct"] - before.get("pieces_direct", 0)
            split = {len(llm.engine.runner.kv_shards) for llm in (prefill, decode)}
            if split == {1} or (kv_cache == "per_rank" and prefill_tp == decode_tp):
                assert staged == 0
                loads = after["loads_requested"] - before.get("loads_requested", 0)
                assert direct == loads * len(decode.engine.runner.kv_shards)
            else:
                assert staged > 0
        assert prefill.drain() and decode.drain()
        for llm in (prefill, decode):  # no block held once the leases are released
            manager = llm.engine.scheduler.kv_cache_manager
            assert manager.num_lent_blocks == 0
            assert manager.block_pool.get_num_free_blocks() == llm.engine.num_kv_blocks
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize(("decode_tp", "kv_cache"), [(2, "auto"), (2, "per_rank"), (1, "per_rank")])
def test_kv_corrupted_after_handoff_is_caught_and_recomputed_at_two_ranks(
    hf_refs, colocated, decode_tp, kv_cache
):
    # The prefill engine's last shard (its shared cache, or rank 1's own) is overwritten
    # after its kv_transfer_params are out: the decode engine's checksums catch it, whether
    # its piece landed in place (2 ranks each) or in staging (1 rank), and it recomputes.
    prefill, decode = _engines(hf_refs["qwen2_bias"].path, "nixl", 2, decode_tp, kv_cache)
    try:
        texts = [prompts(7)[4]]  # 40 tokens
        params = PARAMS[0]
        expected = [o.outputs[0].token_ids for o in colocated.generate(texts, params)]
        handed = prefill.generate(
            texts, SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True}
        )
        block_ids = handed[0].kv_transfer_params["remote_block_ids"]
        prefill.engine.runner.kv_shards[-1].cache[block_ids[1]].add_(1.0)
        before = dict(decode.engine.refresh_stats().kv_transfer)
        output = decode.generate(texts, params, handed[0].kv_transfer_params)[0]
        after = dict(decode.engine.refresh_stats().kv_transfer)
        assert output.outputs[0].token_ids == expected[0]
        assert after["checksum_failures"] - before.get("checksum_failures", 0) >= 1
    finally:
        prefill.close()
        decode.close()
