"""Cache-aware disaggregation and prefix loans, with an index over engines in this process: a
follow-up turn the decode engine holds skips the prefill leg; a prefill engine borrows a prefix
a decode engine holds; a loan nobody reads or releases comes back; a loan the prefill engine
refuses falls back instead of failing."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import pytest
import torch

from deployments.cluster.kv_scoring import CacheSurvey, survey
from deployments.protocol import EngineRequest
from deployments.replica.engine_server import EngineServer
from deployments.router.kv_leases import PrefixBorrower
from engine.outputs import EngineCoreOutput
from engine.request import SamplingParams
from tests.model.flow_utils import idle, run, tokens
from tests.model.orchestrator.shared import ENGINE_ARGS, SECRET, make_flow
from tests.waiting import wait_until


class IndexOf:
    """A ClusterCache over engines in this process: each engine's cache, with its role and
    side channel, announced to the app's real index (KVIndexServer) at every survey; the
    Serve app keeps that index current from the engines' events instead."""

    def __init__(self, engines: dict[str, tuple[str, EngineServer]]) -> None:
        self.engines = engines

    async def survey(self, prompt: list[int], cache_salt: str | None) -> CacheSurvey | None:
        from deployments.cluster.kv_index import KVIndexServer
        from engine.core.kv_cache_utils import prompt_block_hashes
        from engine.core.kv_events import KVSnapshot

        index = KVIndexServer()
        block_size = 16
        for name, (role, server) in self.engines.items():
            pool = server.engine.core.scheduler.kv_cache_manager.block_pool
            cached = server.engine.run_on_loop(pool.cached_block_hashes).result(timeout=10)
            core = server.engine.core
            address = f"{core.config.kv_transfer.side_channel_host}:{core.side_channel_port}"
            index.load_snapshot(name, KVSnapshot("e", 0, tuple(cached)), role, None, address)
        hashes = prompt_block_hashes(prompt, block_size, cache_salt)
        return survey(index.lookup(hashes), hashes, len(prompt), block_size)


@pytest.mark.parametrize("limit", [64, 0], ids=["cache-aware", "off"])
def test_a_follow_up_turn_the_decode_replica_holds_skips_the_prefill_leg(servers, offline, limit):
    """Cache-aware disaggregation: the decode replica that produced turn one's answer holds
    the prompt and the answer; turn two's prompt adds a short tail, which that replica
    computes itself (route decode_cached, the request hinted to it) instead of a prefill
    replica recomputing the answer and moving the whole prompt's KV."""
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    decode = EngineServer("tiny", ENGINE_ARGS, kv)
    prefill_calls: list[EngineRequest] = []
    decode_calls: list[EngineRequest] = []

    def recording(fn: Any, calls: list[EngineRequest]) -> Any:
        def call(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
            calls.append(request)
            return fn(request)

        return call

    try:
        flow = make_flow(
            (servers[0], decode),
            prefill=recording(servers[0].generate, prefill_calls),
            decode=recording(decode.generate, decode_calls),
            max_local_prefill_tokens=limit,
        )
        flow.cluster_cache = IndexOf({"decode-0": ("decode", decode)})
        params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        first_prompt = list(range(100, 140))
        first = run(flow, first_prompt, **params)
        assert {c.route for c in first} == {"disaggregated"}  # nothing cached anywhere yet
        follow_up = first_prompt + tokens(first) + list(range(300, 310))
        expected = offline.generate([follow_up], SamplingParams(**params))[0]
        prefill_calls.clear()
        decode_calls.clear()
        second = run(flow, follow_up, **params)
        assert tokens(second) == expected.outputs[0].token_ids
        if limit:
            assert {c.route for c in second} == {"decode_cached"}
            assert not prefill_calls
            assert [r.replica_hint for r in decode_calls] == ["decode-0"]
            # Every full block of turn one's computed KV was read from the cache: its prompt
            # and answer but the last answer token, which was sampled and never fed back.
            assert second[-1].usage.cached_tokens == (40 + 24 - 1) // 16 * 16
        else:
            assert {c.route for c in second} == {"disaggregated"}
            assert len(prefill_calls) == 1
        # Each leg carries the survey's holdings: its request router asks the index no more.
        for leg in [*prefill_calls, *decode_calls]:
            assert set(leg.routing_holdings or {}) == {"decode-0"}
        assert idle(servers[0]) and idle(decode)
    finally:
        decode.__del__()


@pytest.mark.parametrize(
    ("min_loan", "lender_ranks", "kv_cache"),
    [(32, 1, "auto"), (0, 1, "auto"), (32, 2, "auto"), (32, 2, "per_rank")],
    ids=["loan", "off", "loan-tp2", "loan-tp2-per-rank"],
)
def test_a_prefill_engine_borrows_the_prefix_a_decode_engine_holds(
    servers, offline, min_loan, lender_ranks, kv_cache
):
    """Prefix loans: turn two goes to a prefill engine that never saw turn one. The decode
    engine that wrote turn one's answer holds its prompt and answer; it lends those blocks
    (LendPrefix, under a lease), the prefill engine reads them over the side channel's
    transport and computes only the rest, and the answer is the one offline generation
    gives. Afterwards no engine holds a block. A lender of two tensor-parallel ranks lends
    blocks of the cache its ranks share (every head), or, each rank keeping its own heads'
    cache (as on GPUs), one shard per rank: the borrower reads each shard's heads staged into
    its cache of every head."""
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    split = {"tensor_parallel_size": lender_ranks, "tensor_parallel_kv_cache": kv_cache}
    decode = EngineServer("tiny", {**ENGINE_ARGS, **split}, kv)
    fresh = EngineServer("tiny", ENGINE_ARGS, kv)  # the second turn's prefill engine
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    try:
        assert len(decode.rank_pids()) == lender_ranks - 1
        cache = IndexOf({"decode-0": ("decode", decode), "prefill-1": ("prefill", fresh)})
        loans = {"max_local_prefill_tokens": 16, "min_prefix_loan_tokens": min_loan}
        first_flow = make_flow((servers[0], decode), **loans)
        first_prompt = list(range(100, 140))
        first = run(first_flow, first_prompt, **params)
        follow_up = first_prompt + tokens(first) + list(range(300, 340))
        flow = make_flow((fresh, decode), **loans)
        flow.cluster_cache = cache
        flow.borrower = PrefixBorrower(SECRET, 16, min_loan)
        second = run(flow, follow_up, **params)
        expected = offline.generate([follow_up], SamplingParams(**params))[0]
        assert tokens(second) == expected.outputs[0].token_ids
        assert {c.route for c in second} == {"disaggregated"}  # 40 new tokens > 16
        stats = fresh.engine.core.connector.stats
        if min_loan:
            # Turn one's KV but its last answer token: 63 tokens, 3 whole blocks, read, and
            # each checked against the checksum its lender computed.
            assert stats["blocks_read"] == stats["blocks_verified"] == 3
            assert stats["pieces_staged"] == (lender_ranks if kv_cache == "per_rank" else 0)
        else:
            assert stats["blocks_read"] == 0
        assert stats["checksum_failures"] == 0
        assert idle(servers[0]) and idle(decode) and idle(fresh)
        assert decode.engine.core.scheduler.kv_cache_manager.num_lent_blocks == 0
    finally:
        decode.__del__()
        fresh.__del__()


def test_a_lent_block_that_changed_before_the_read_is_recomputed(servers, offline):
    """A lender's block changes after it was lent (a bit flipped in its memory): the
    borrowing prefill engine's checksum catches it before computing from it, recomputes from
    that block, and the answer is still offline generation's."""
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    decode = EngineServer("tiny", ENGINE_ARGS, kv)
    fresh = EngineServer("tiny", ENGINE_ARGS, kv)
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}

    class CorruptingBorrower(PrefixBorrower):
        async def borrow(self, prompt, survey):
            loan = await super().borrow(prompt, survey)
            assert loan is not None  # the test is about a loan
            cache = decode.engine.core.runner.kv_cache
            flat = cache.view(cache.shape[0], -1).view(torch.uint8)
            flat[loan["remote_block_ids"][1], 3] ^= 0x40  # a float32's top exponent bit
            return loan

    try:
        loans = {"max_local_prefill_tokens": 16, "min_prefix_loan_tokens": 32}
        first_prompt = list(range(600, 640))
        first = run(make_flow((servers[0], decode), **loans), first_prompt, **params)
        follow_up = first_prompt + tokens(first) + list(range(300, 340))
        # The decode leg runs elsewhere: the lender's own copy stays changed (faulty memory
        # of an engine is beyond what a transfer check can see).
        flow = make_flow((fresh, servers[1]), **loans)
        flow.cluster_cache = IndexOf(
            {"decode-0": ("decode", decode), "prefill-1": ("prefill", fresh)}
        )
        flow.borrower = CorruptingBorrower(SECRET, 16, 32)
        second = run(flow, follow_up, **params)
        expected = offline.generate([follow_up], SamplingParams(**params))[0]
        assert tokens(second) == expected.outputs[0].token_ids
        stats = fresh.engine.core.connector.stats
        assert stats["blocks_read"] == 3 and stats["blocks_verified"] == 2
        assert stats["checksum_failures"] == stats["blocks_corrupted"] == 1
        assert all(idle(e) for e in (*servers, decode, fresh))
    finally:
        decode.__del__()
        fresh.__del__()


def test_a_loan_nobody_reads_is_released_and_an_engine_lends_nothing_it_lacks(servers):
    """The lender's side: blocks are lent only for hashes it holds, stay out of eviction
    while lent, and come back when the lease is released."""
    from connector.side_channel_client import SideChannelClient, SideChannelError
    from engine.block_checksums import block_checksums
    from engine.core.kv_cache_utils import prompt_block_hashes

    engine = servers[1]
    prompt = list(range(500, 548))
    list(run(make_flow(servers), prompt, max_tokens=2, temperature=0.0))
    assert idle(engine)
    core = engine.engine.core
    client = SideChannelClient(
        core.config.kv_transfer.side_channel_host, core.side_channel_port, SECRET
    )
    try:
        hashes = prompt_block_hashes(prompt, 16)
        assert client.lend_prefix(prompt_block_hashes(list(range(900, 948)), 16)).block_ids == []
        with pytest.raises(SideChannelError, match="INVALID_ARGUMENT"):
            client.lend_prefix([])
        reply = client.lend_prefix(hashes)
        assert len(reply.block_ids) == 3 and reply.lease_id
        # With the checksums of the lent blocks as they are (the borrower verifies its read).
        assert reply.block_checksums == block_checksums(core.runner.kv_cache, reply.block_ids)
        # Held for the borrower, as the engine's stats say once it has stepped (they are as
        # of its last step).
        stats = engine.stats()
        assert wait_until(
            lambda: engine.stats()["num_free_blocks"] == stats["num_blocks"] - 3, 10
        ), engine.stats()
        assert client.release(reply.lease_id)
        assert idle(engine)
        assert engine.engine.core.scheduler.kv_cache_manager.num_lent_blocks == 0
    finally:
        client.close()


def test_a_loan_nobody_releases_expires_and_its_blocks_come_back(offline):
    """A borrower that never reads nor releases: the lease expires, and the lender frees the
    blocks on its own (nothing pinned for nobody)."""
    from connector.side_channel_client import SideChannelClient
    from engine.core.kv_cache_utils import prompt_block_hashes

    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 0.5}
    lender = EngineServer("tiny", ENGINE_ARGS, kv)
    core = lender.engine.core
    client = SideChannelClient(
        core.config.kv_transfer.side_channel_host, core.side_channel_port, SECRET
    )
    try:
        prompt = list(range(600, 648))
        run(make_flow((lender, lender), prefill=None), prompt, max_tokens=2, temperature=0.0)
        reply = client.lend_prefix(prompt_block_hashes(prompt, 16))
        assert len(reply.block_ids) == 3  # the prompt's three full blocks
        assert core.scheduler.kv_cache_manager.num_lent_blocks == 3
        # Expired and freed, not read by anyone; then the stats (as of the engine's last step,
        # so maybe still from before the loan) say so too.
        assert wait_until(lambda: core.scheduler.kv_cache_manager.num_lent_blocks == 0, 10)
        assert idle(lender, timeout_s=10)
        assert core.scheduler.kv_cache_manager.num_lent_blocks == 0
    finally:
        client.close()
        lender.__del__()


def test_a_loan_the_prefill_engine_refuses_falls_back_instead_of_failing(servers, offline):
    """A loan made for other tokens is refused by the prefill engine (ValueError): that is no
    fault of the client's request, which is served decode-only with the right tokens."""

    class WrongLoan:
        async def borrow(self, prompt, survey):
            return {
                "do_remote_prefill": True,
                "remote_engine_id": "elsewhere",
                "remote_request_id": "lend-x",
                "remote_block_ids": [1],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "lease_id": "l",
                "remote_num_tokens": 16,
                "remote_tokens_hash": "not these tokens",
                "remote_block_checksums": ["0" * 16],
            }

    flow = make_flow(servers)
    flow.borrower = WrongLoan()
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    prompt = list(range(700, 740))
    chunks = run(flow, prompt, **params)
    expected = offline.generate([prompt], SamplingParams(**params))[0]
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert {c.route for c in chunks} == {"fallback"}
    assert idle(servers[0]) and idle(servers[1])
