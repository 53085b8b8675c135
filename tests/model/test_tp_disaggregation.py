"""Prefill and decode engines of different tensor-parallel sizes, both directions, over NIXL
and gRPC: the decode engine's output equals one colocated single-rank engine's, greedy and
seeded, and its KV came over the transport (blocks read, checksums verified), not recomputed.

The ranks of an engine on one CPU host share one KV cache of every head (each attends over
its own), so what the connector registers and moves is whole blocks of every head, whatever
either side's size."""

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


def _engines(path: str, transport: str, prefill_tp: int, decode_tp: int) -> tuple[LLM, LLM]:
    kv = {"connector": transport, "secret": secrets.token_hex(16)}
    prefill = LLM(path, tensor_parallel_size=prefill_tp, kv_transfer_config=kv, **ARGS)
    decode = LLM(path, tensor_parallel_size=decode_tp, kv_transfer_config=kv, **ARGS)
    return prefill, decode


@pytest.mark.parametrize(
    ("transport", "prefill_tp", "decode_tp"),
    [("nixl", 2, 1), ("nixl", 1, 2), ("grpc", 2, 1), ("grpc", 1, 2), ("nixl", 2, 2)],
)
def test_handoff_between_tensor_parallel_sizes_equals_colocated(
    hf_refs, colocated, transport, prefill_tp, decode_tp
):
    prefill, decode = _engines(hf_refs["qwen2_bias"].path, transport, prefill_tp, decode_tp)
    try:
        for llm, size in ((prefill, prefill_tp), (decode, decode_tp)):
            runner = llm.engine.runner
            assert runner.group.size == size
            assert runner.kv_cache.shape[4] == llm.engine.arch.num_key_value_heads  # every head
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
        assert prefill.drain() and decode.drain()
        for llm in (prefill, decode):  # no block held once the leases are released
            manager = llm.engine.scheduler.kv_cache_manager
            assert manager.num_lent_blocks == 0
            assert manager.block_pool.get_num_free_blocks() == llm.engine.num_kv_blocks
    finally:
        prefill.close()
        decode.close()


def test_kv_corrupted_after_handoff_is_caught_and_recomputed_at_two_ranks(hf_refs, colocated):
    # The prefill engine's shared cache (every rank's heads) is overwritten after its
    # kv_transfer_params are out: the decode engine's checksums catch it and it recomputes.
    prefill, decode = _engines(hf_refs["qwen2_bias"].path, "nixl", 2, 2)
    try:
        texts = [prompts(7)[4]]  # 40 tokens
        params = PARAMS[0]
        expected = [o.outputs[0].token_ids for o in colocated.generate(texts, params)]
        handed = prefill.generate(
            texts, SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True}
        )
        block_ids = handed[0].kv_transfer_params["remote_block_ids"]
        prefill.engine.runner.kv_cache[block_ids[1]].add_(1.0)
        before = dict(decode.engine.refresh_stats().kv_transfer)
        output = decode.generate(texts, params, handed[0].kv_transfer_params)[0]
        after = dict(decode.engine.refresh_stats().kv_transfer)
        assert output.outputs[0].token_ids == expected[0]
        assert after["checksum_failures"] - before.get("checksum_failures", 0) >= 1
    finally:
        prefill.close()
        decode.close()
