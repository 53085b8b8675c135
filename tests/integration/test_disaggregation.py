"""Prefill process -> decode process over real KV transfer (NIXL or gRPC), against colocated.

Every engine here is a real process with a real side channel; the test process only drives
them over pipes. After each scenario both engines must be idle with every block free.
"""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from engine.core.kv_cache_utils import cdiv
from engine.llm import LLM
from engine.models.default_model import make_default_model
from engine.request import SamplingParams
from tests.integration.engine_proc import EngineProcess
from tests.integration.pd_engines import (
    BLOCK,
    ENGINE,
    PATIENT,
    SHIPPED,
    assert_idle_and_clean,
    engine,
    kv_config,
    prefill_then_decode,
    reference,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TRANSPORTS = ["grpc", "nixl"]

rng = random.Random(7)
SHARED = [rng.randrange(10, 2000) for _ in range(24)]  # 3 whole blocks
PROMPTS = [
    SHARED + [rng.randrange(10, 2000) for _ in range(9)],  # 33 tokens
    [rng.randrange(10, 2000) for _ in range(20)],
    [rng.randrange(10, 2000) for _ in range(5)],
    [rng.randrange(10, 2000) for _ in range(47)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated() -> LLM:
    return LLM("tiny", **ENGINE)


@pytest.fixture(scope="module", params=TRANSPORTS)
def pair(request):
    transport = request.param
    prefill, decode = engine(transport), engine(transport)
    yield transport, prefill, decode
    prefill.close()
    decode.close()


def test_disaggregated_is_token_identical_to_colocated(pair, colocated):
    _, prefill, decode = pair
    params = [GREEDY, SEEDED, GREEDY, replace(SEEDED, seed=12)]
    expected = reference(colocated, PROMPTS, params)
    before = decode.drain()["stats"]
    firsts, outs = prefill_then_decode(prefill, decode, PROMPTS, params)
    for first, out, want in zip(firsts, outs, expected, strict=True):
        assert first["token_ids"] == want[:1]  # the prefill's token, streamed first
        assert first["kv_transfer_params"]["do_remote_prefill"] is True
        assert out["token_ids"] == want
        assert out["finish_reason"] == "length"
    after = decode.drain()["stats"]
    # Every block read was checked against the checksum its producer computed, and matched.
    read = after["blocks_read"] - before["blocks_read"]
    assert read == sum(cdiv(len(p) - 1, BLOCK) for p in PROMPTS)
    assert after["blocks_verified"] - before["blocks_verified"] == read
    assert after["checksum_failures"] == before["checksum_failures"] == 0
    assert_idle_and_clean(prefill, decode)


def test_the_apps_decode_leg_takes_the_whole_prompts_kv_with_its_first_token(pair, colocated):
    """The app's decode leg has the prefill engine's first token forced: the decode engine
    reads the KV of every prompt token, the last one's block too, takes that token as sampled
    and computes from the next position on, as a colocated engine does after its prefill."""
    _, prefill, decode = pair
    prompts = [[rng.randrange(10, 2000) for _ in range(n)] for n in (33, 20, 41, 9)]
    params = [GREEDY, SEEDED, replace(SEEDED, seed=12), GREEDY]
    expected = reference(colocated, prompts, params)
    before = decode.drain()["stats"]
    one = [replace(p, max_tokens=1) for p in params]
    firsts = prefill.generate(prompts, one, {"do_remote_decode": True})
    legs = [
        replace(p, forced_output_token_ids=f["token_ids"])
        for p, f in zip(params, firsts, strict=True)
    ]
    outs = decode.generate(prompts, legs, [f["kv_transfer_params"] for f in firsts])
    for out, want in zip(outs, expected, strict=True):
        assert out["token_ids"] == want
        assert out["adopted_first_token"]
    after = decode.drain()["stats"]
    read = after["blocks_read"] - before["blocks_read"]
    assert read == sum(cdiv(len(p), BLOCK) for p in prompts)  # 33 and 41: one block more
    assert after["blocks_verified"] - before["blocks_verified"] == read
    assert_idle_and_clean(prefill, decode)


def corrupted_hand_off(prefill, decode, how: str) -> tuple[list[int], dict]:
    """A fresh prompt prefilled, then its second block changed in the prefill engine's memory
    (`how`: see engine_proc._corrupt_blocks; "reused while read": reused just after the
    reader's lease check, while it reads) after its kv_transfer_params were handed out; the
    decode engine reads it, the prefill's token forced as in the app: every prompt token's
    block (5), to adopt that token, which a failed load never does. (The prompt, the decode
    engine's output.)"""
    prompt = [rng.randrange(10, 2000) for _ in range(33)]
    firsts = prefill.generate([prompt], [replace(GREEDY, max_tokens=1)], {"do_remote_decode": True})
    kv = firsts[0]["kv_transfer_params"]
    if how == "reused while read":
        prefill.call("reuse_after_next_renewal", kv["remote_block_ids"][1:2])
    else:
        prefill.call("corrupt_blocks", kv["remote_block_ids"][1:2], how)
    leg = replace(GREEDY, forced_output_token_ids=firsts[0]["token_ids"])
    out = decode.generate([prompt], [leg], [kv])[0]
    assert not out["adopted_first_token"]  # recomputed from the bad block on
    return prompt, out


def test_kv_changed_after_the_hand_off_is_caught_before_any_token(pair, colocated):
    """Never a wrong token: a block that changed after it was handed out (faulty memory, a
    block freed and reused) fails its checksum on the decode engine before anything is
    computed from it. Under policy recompute the decode engine recomputes from that block and
    answers as colocated does; under policy fail the request ends with a clear error."""
    transport, prefill, decode = pair
    decode_fail = engine(transport, kv={"kv_load_failure_policy": "fail"})
    try:
        for how in ("flip", "stale"):
            before = decode.drain()["stats"]
            prompt, out = corrupted_hand_off(prefill, decode, how)
            after = decode.drain()["stats"]
            assert out["token_ids"] == reference(colocated, [prompt], [GREEDY])[0], how
            assert after["checksum_failures"] - before["checksum_failures"] == 1, how
            assert after["blocks_corrupted"] - before["blocks_corrupted"] == 1, how
            assert after["blocks_verified"] - before["blocks_verified"] == 4, how
            _, out = corrupted_hand_off(prefill, decode_fail, how)
            assert out["finish_reason"] == "error", how
            assert "loading remote KV failed" in out["error"], how
        stats = decode_fail.drain()["stats"]
        assert stats["checksum_failures"] == 2 and stats["reads_failed"] == 0
        assert_idle_and_clean(prefill, decode, decode_fail)
    finally:
        decode_fail.close()


def test_a_lent_block_rewritten_under_its_lease_is_fenced(pair, colocated):
    """Fencing: a lent block whose generation moved after the hand-off (freed and taken by
    another request that has not written it yet, so its bytes and checksum still match) is
    never used. The producer refuses it (gRPC: at the stream; NIXL's one-sided read: at the
    release after it), the reader counts the read fenced, and the policy recomputes it (the
    answer is colocated's) or fails the request with a clear error."""
    transport, prefill, decode = pair
    decode_fail = engine(transport, kv={"kv_load_failure_policy": "fail"})
    try:
        producer = prefill.drain()["stats"]
        # Before the read (its lease check refuses it), and while it reads (gRPC: the stream
        # stops at that block; NIXL reads it all, and the release says it is not to be used).
        for how in ("reused", "reused while read"):
            before = decode.drain()["stats"]
            prompt, out = corrupted_hand_off(prefill, decode, how)
            after = decode.drain()["stats"]
            assert out["token_ids"] == reference(colocated, [prompt], [GREEDY])[0], how
            assert after["fenced_reads"] - before["fenced_reads"] == 1, how
            assert after["reads_failed"] - before["reads_failed"] == 1, how
            # Its bytes were the ones lent: only the fence could see it.
            assert after["checksum_failures"] == before["checksum_failures"], how
        _, out = corrupted_hand_off(prefill, decode_fail, "reused while read")
        assert out["finish_reason"] == "error"
        assert "loading remote KV failed" in out["error"]
        assert decode_fail.drain()["stats"]["fenced_reads"] == 1
        fences = prefill.drain()["stats"]["generation_fences"] - producer["generation_fences"]
        assert fences == 3  # one per read (its lease), however many calls each refused
        assert_idle_and_clean(prefill, decode, decode_fail)
    finally:
        decode_fail.close()


def test_partial_local_hit_reads_only_the_missing_tail(pair, colocated):
    transport, prefill, decode = pair
    # A prefix of 3 whole blocks this decode engine has never seen.
    shared = [1000 + i + (7 if transport == "nixl" else 0) for i in range(24)]
    a = [*shared, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # 33 tokens
    b = [*shared, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]  # 35 tokens
    before = decode.drain()["stats"]
    _, out_a = prefill_then_decode(prefill, decode, [a], [GREEDY])
    mid = decode.drain()["stats"]
    _, out_b = prefill_then_decode(prefill, decode, [b], [GREEDY])
    after = decode.drain()["stats"]
    # KV of all prompt tokens but the last comes from the prefill engine...
    assert mid["blocks_read"] - before["blocks_read"] == cdiv(len(a) - 1, BLOCK)
    # ...except the 3 shared blocks b finds in the decode engine's own prefix cache.
    assert after["blocks_read"] - mid["blocks_read"] == cdiv(len(b) - 1, BLOCK) - 3
    assert out_a[0]["token_ids"] == reference(colocated, [a], [GREEDY])[0]
    assert out_b[0]["token_ids"] == reference(colocated, [b], [GREEDY])[0]
    # The same prompt again: everything is cached locally, nothing is read, the lease is
    # released all the same.
    _, again = prefill_then_decode(prefill, decode, [a], [GREEDY])
    last = decode.drain()["stats"]
    assert last["blocks_read"] == after["blocks_read"]
    assert last["releases_without_read"] == after["releases_without_read"] + 1
    assert again[0]["token_ids"] == out_a[0]["token_ids"]
    assert_idle_and_clean(prefill, decode)


def test_every_injected_data_fault_is_caught(pair, colocated):
    """kv_transfer_config.fault_injection at rate 1: every read has a flipped bit, a lost
    tail or a stale block put into it after it lands. Each is caught by its checksum (as many
    detections as injections) and recomputed: the outputs are colocated's."""
    faults = {"rate": 1.0, "seed": 5, "faults": ["flip", "truncate", "stale"]}
    stats = decode_with_faults(pair, colocated, faults, (33, 20, 47, 12, 40, 25))
    assert stats["faults_injected"] >= 4  # one per read, unless it would change nothing
    assert stats["checksum_failures"] == stats["faults_injected"]
    assert stats["blocks_corrupted"] == stats["faults_injected"]  # one block each


def test_every_injected_transport_fault_ends_well(pair, colocated):
    """fault_injection at rate 1 with the transport's faults: completions delayed (the read
    is used), lost (the reader's deadline ends the read) and remotes dying mid-read. Lost and
    dead reads are recomputed: the outputs are colocated's, and no block is held after."""
    faults = {"rate": 1.0, "seed": 3, "faults": ["delay", "lose", "die"], "delay_s": 0.1}
    lost_in_a_second = {**PATIENT, "read_timeout_base_s": SHIPPED["read_timeout_base_s"]}
    stats = decode_with_faults(pair, colocated, faults, (30, 21, 45, 14, 38, 26), lost_in_a_second)
    injected = [stats[f"faults_{kind}"] for kind in ("delayed", "lost", "died")]
    assert all(injected) and sum(injected) == stats["loads_requested"]  # one per read
    # A lost completion ends at the read's deadline (a delayed one too, on a machine slow
    # enough to pass it); a remote dying fails its read at once.
    assert stats["timed_out_reads"] >= stats["faults_lost"]
    assert stats["reads_failed"] == stats["timed_out_reads"] + stats["faults_died"]
    assert stats["blocks_verified"] > 0 and stats["checksum_failures"] == 0


def decode_with_faults(
    pair, colocated, faults: dict, lengths: tuple[int, ...], deadlines: dict = PATIENT
) -> dict:
    """Prompts of `lengths` through the pair's prefill engine and a decode engine with
    `faults` injected into its reads (and `deadlines` on its remotes): outputs must be
    colocated's and both engines idle and clean after; the decode engine's counters."""
    transport, prefill, _ = pair
    decode = engine(transport, kv={"fault_injection": faults, **deadlines})
    prompts = [[rng.randrange(10, 2000) for _ in range(n)] for n in lengths]
    params = [GREEDY, SEEDED] * (len(prompts) // 2)
    try:
        _, outs = prefill_then_decode(prefill, decode, prompts, params)
        assert [o["token_ids"] for o in outs] == reference(colocated, prompts, params)
        stats = decode.drain()["stats"]
        assert_idle_and_clean(prefill, decode)
        return stats
    finally:
        decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_faults_recover_or_fail_cleanly(transport, colocated):
    prompts, params = PROMPTS[:2], [GREEDY, SEEDED]
    expected = reference(colocated, prompts, params)
    decode = engine(transport)
    decode_fail = engine(transport, kv={"kv_load_failure_policy": "fail"})
    prefill = engine(transport)
    try:
        # A transfer failing mid-way: recomputed locally, same tokens.
        decode.call("inject_failure", 1)
        _, outs = prefill_then_decode(prefill, decode, prompts, params)
        assert [o["token_ids"] for o in outs] == expected
        # Bogus block ids: refused by the remote or the transport; recomputed.
        bogus = lambda kv: {**kv, "remote_block_ids": [10**6] * len(kv["remote_block_ids"])}  # noqa: E731
        _, outs = prefill_then_decode(prefill, decode, prompts, params, tamper=bogus)
        assert [o["token_ids"] for o in outs] == expected
        # Under policy "fail" the same faults end the request with a clear error.
        _, outs = prefill_then_decode(prefill, decode_fail, prompts, params, tamper=bogus)
        assert all(o["finish_reason"] == "error" for o in outs)
        assert all("loading remote KV failed" in o["error"] for o in outs)
        decode_fail.call("inject_failure", 1)
        _, outs = prefill_then_decode(prefill, decode_fail, prompts, params)
        assert [o["finish_reason"] for o in outs].count("error") == 1  # the injected read
        assert [o["token_ids"] for o in outs if o["finish_reason"] != "error"] in (
            [expected[0]],
            [expected[1]],
        )
        # An aborted prefill-side request ends its lease: a later read is refused.
        firsts = prefill.generate(
            prompts, [replace(p, max_tokens=1) for p in params], {"do_remote_decode": True}
        )
        prefill.call("abort", [f["kv_transfer_params"]["remote_request_id"] for f in firsts])
        assert_idle_and_clean(prefill)
        outs = decode.generate(prompts, params, [f["kv_transfer_params"] for f in firsts])
        assert [o["token_ids"] for o in outs] == expected
        # The prefill process dies after handing out its params, before the read.
        firsts = prefill.generate(
            prompts, [replace(p, max_tokens=1) for p in params], {"do_remote_decode": True}
        )
        prefill.kill()
        kv = [f["kv_transfer_params"] for f in firsts]
        outs = decode.generate(prompts, params, kv)
        assert [o["token_ids"] for o in outs] == expected
        outs = decode_fail.generate(prompts, params, kv)
        assert all(o["finish_reason"] == "error" and o["error"] for o in outs)
        assert_idle_and_clean(decode, decode_fail)
    finally:
        for proc in (decode, decode_fail, prefill):
            proc.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refused_peers_and_lease_expiry(transport, colocated, tmp_path):
    """Peers the handshake refuses: a wrong secret, another block layout, other weights of
    the same architecture (the weights fingerprint in the compatibility hash). The decode
    engine recomputes: its outputs are its own weights' (colocated's)."""
    prompts, params = PROMPTS[2:], [GREEDY, SEEDED]
    expected = reference(colocated, prompts, params)
    decode = engine(transport)
    wrong_secret = engine(transport, kv={"secret": "not-the-secret", "lease_seconds": 0.5})
    other_layout = engine(transport, block_size=16)
    other_weights = EngineProcess(
        str(make_default_model(tmp_path / "other", seed=7)),
        **ENGINE,
        kv_transfer_config=kv_config(transport),
    )
    refused = (wrong_secret, other_layout, other_weights)
    try:
        for prefill in refused:
            _, outs = prefill_then_decode(prefill, decode, prompts, params)
            assert [o["token_ids"] for o in outs] == expected
        stats = decode.drain()["stats"]
        assert stats["blocks_read"] == 0 and stats["reads_failed"] == 6  # all refused
        assert_idle_and_clean(*refused, decode)  # nobody read the wrong-secret engine's blocks:
        assert wrong_secret.drain()["stats"]["leases_expired"] == 2  # its 0.5 s leases expired
    finally:
        for proc in (decode, *refused):
            proc.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_engine_that_stops_answering_fails_its_reads_at_once(transport, colocated):
    """A prefill engine frozen (SIGSTOP: alive, silent) after handing out its params, and
    over gRPC in the middle of the reads: the decode engine gives up on them within about a
    second (connector/read_watch.py, or the read's own deadline), not at the transport's
    deadline or the lease's end, and
    recomputes (or, under policy fail, ends the requests with a clear error)."""
    params = [GREEDY, SEEDED]
    decode, prefill = engine(transport, kv=SHIPPED), None
    decode_fail = engine(transport, kv={**_FAIL, **SHIPPED})
    cases = [(decode, False, PROMPTS[:2]), (decode_fail, False, PROMPTS[:2])]
    if transport == "grpc":  # a NIXL read is one-sided: it needs nothing of the frozen engine
        cases.append((decode, True, PROMPTS[2:]))  # not cached here yet: both are read
    try:
        for reader, mid_read, prompts in cases:
            prefill = engine(transport)
            if mid_read:
                prefill.call("hold_reads")
            firsts = prefill.generate(
                prompts, [replace(p, max_tokens=1) for p in params], {"do_remote_decode": True}
            )
            kv = [f["kv_transfer_params"] for f in firsts]
            if not mid_read:
                os.kill(prefill.process.pid, signal.SIGSTOP)
            outs = _generate_freezing(reader, prefill if mid_read else None, prompts, params, kv)
            if reader is decode:
                assert [o["token_ids"] for o in outs] == reference(colocated, prompts, params)
            else:
                assert all(o["finish_reason"] == "error" and o["error"] for o in outs)
            prefill.kill()
        stats = decode.drain()["stats"]
        assert stats["reads_failed"] == (4 if transport == "grpc" else 2)
        # Mid-read, the stream itself says nothing: the watch's heartbeat or the reader's
        # own deadline (1 s and the bytes at 100 MB/s) ended both reads, whichever came first.
        given_up = stats["unanswered_reads"] + stats["timed_out_reads"]
        assert given_up == (2 if transport == "grpc" else 0)
        assert_idle_and_clean(decode, decode_fail)
    finally:
        for proc in (decode, decode_fail, prefill):
            if proc is not None:
                proc.close()


_FAIL = {"kv_load_failure_policy": "fail"}


def _generate_freezing(reader, frozen, prompts, params, kv) -> list[dict]:
    """reader.generate; with `frozen`, that engine stopped once all reads from it are held."""
    if frozen is None:
        return reader.generate(prompts, params, kv)
    with ThreadPoolExecutor(1) as pool:
        outs = pool.submit(reader.generate, prompts, params, kv)
        assert wait_until(lambda: frozen.call("held_reads") >= len(prompts), 60)
        os.kill(frozen.process.pid, signal.SIGSTOP)
        return outs.result(timeout=120)


def test_decode_abort_during_a_read_frees_blocks_only_after_the_read_stopped(colocated):
    # gRPC only: the stream can be held so that the abort lands mid-read.
    prefill, decode = engine("grpc"), engine("grpc")
    try:
        prefill.call("hold_reads")
        prompts, params = PROMPTS[:2], [GREEDY, GREEDY]
        firsts = prefill.generate(
            prompts, [replace(p, max_tokens=1) for p in params], {"do_remote_decode": True}
        )
        kv = [f["kv_transfer_params"] for f in firsts]
        state = decode.call("abort_during_read", prompts, params, kv)
        assert state["aborted_while_reading"] == 2
        assert state["held_after_abort"] == 2  # the blocks wait for the reads to stop
        prefill.call("release_reads")  # the held streams go on, find their calls cancelled
        assert_idle_and_clean(decode, prefill)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_engine_restarted_on_its_address_is_read_from_again(transport, colocated):
    """A prefill engine killed (SIGKILL) and started again on the same side-channel port (a
    restarted container keeps its pod's address) is a new engine (new id, new NIXL agent): the
    decode engine handshakes with it again and reads, rather than failing on what it knew of
    the old one (vLLM issue #49238)."""
    decode, prefill = engine(transport), engine(transport)
    port = prefill.port
    params = [GREEDY]
    want = reference(colocated, PROMPTS[:2], params * 2)
    try:
        firsts, outs = prefill_then_decode(prefill, decode, PROMPTS[:1], params)
        assert outs[0]["token_ids"] == want[0]
        prefill.kill()
        prefill = engine(transport, kv={"side_channel_port": port})
        assert prefill.port == port
        again, outs = prefill_then_decode(prefill, decode, PROMPTS[1:2], params)
        before = firsts[0]["kv_transfer_params"]
        after = again[0]["kv_transfer_params"]
        assert after["remote_engine_id"] != before["remote_engine_id"]
        assert after["remote_port"] == before["remote_port"] == port
        assert outs[0]["token_ids"] == want[1]
        stats = decode.drain()["stats"]
        assert stats["reads_failed"] == 0 and stats["blocks_read"] >= 2  # read, not recomputed
        assert stats["remote_engines"] == 1  # the old engine forgotten
        assert_idle_and_clean(prefill, decode)
    finally:
        prefill.close()
        decode.close()
