"""KV-aware routing on real local Ray Serve: 2 prefill + 2 decode replicas of the tiny model.

The engines publish their prefix caches' events (and their load) to the app's KV index actor;
both legs' Serve request routers send a request to the replica that would serve it cheapest,
and the Router skips the prefill leg when a decode replica holds all but a short tail of the
prompt (cache-aware disaggregation, `max_local_prefill_tokens`). A conversation's follow-up
turn extends the earlier turn's prompt and answer, so it finds them cached — which only
cache-aware routing guarantees (power of two choices over two replicas would send each
follow-up to the other replica half the time).

The module's tests share one app and run in order; the last one kills a replica.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from deployments.cluster.kv_index import index_actor_name
from deployments.launch import APP_NAME
from engine.core.kv_cache_utils import prompt_block_hashes
from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.client import Completion, GenerationClient, generate_request
from tests.integration.serving import AppSettings, ServeCluster, ServedApp, replica_actors
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
logger = logging.getLogger(__name__)

BLOCK = 16
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 16 << 20, "block_size": BLOCK}
ANSWER_TOKENS = 12
# A follow-up of SHORT new tokens leaves a tail of at most 15 + 1 + SHORT tokens uncached on
# the decode replica that wrote the answer (<= LOCAL: it computes the tail itself); LONG new
# tokens leave more than LOCAL (a prefill replica computes them, reusing the earlier prompt).
LOCAL, SHORT, LONG = 32, 8, 40
# A prefill leg borrows what an engine holds beyond the prefill replicas by this much.
LOAN = 16
PARAMS = {"max_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True}


SETTINGS = AppSettings(
    app={
        "model": "tiny",
        "engine_args": ENGINE_ARGS,
        "prefill_replicas": 2,
        "decode_replicas": 2,
        # A CPU each: as many engines as the machine has cores pin to one of their own (in
        # cores claimed by this session's Ray alone: tests/integration/conftest.py).
        "num_cpus_per_engine": 1,
        "transport": "nixl",
        "max_local_prefill_tokens": LOCAL,
        "min_prefix_loan_tokens": LOAN,
        # Replicas may switch roles, but the balancer never moves one here (no load comes
        # near these targets): the role-switching test orders its switches itself, through
        # the index as the balancer's orders go. Requests a switch drains move after 0.2 s.
        "role_switching": {
            "ttft_s": 1e6,
            "queued_prompt_tokens": 1e12,
            "tpot_s": 1e6,
            "kv_cache_usage": 1e6,
            "running_requests": 1e6,
            "drain_timeout_s": 0.2,
        },
    }
)


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster) -> Iterator[ServedApp]:
    with serve_cluster.serving(SETTINGS) as app:
        yield app


@pytest.fixture(scope="module")
def client(served: ServedApp) -> GenerationClient:
    return served.client


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", **ENGINE_ARGS)


def index_actor() -> ray.actor.ActorHandle:
    return ray.get_actor(index_actor_name(APP_NAME), namespace="pdserve")


def index_knows_all_engines() -> bool:
    current = ray.get(index_actor().current.remote())
    return len(current) == 4 and all(current.values())


def check(done: Completion, prompt: list[int], offline: LLM) -> None:
    """The oracle: the answer equals offline greedy generation."""
    expected = offline.generate([{"prompt_token_ids": prompt}], SamplingParams(**PARAMS))[0]
    assert done.token_ids == expected.outputs[0].token_ids


def blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


def test_follow_up_turns_find_their_earlier_context_cached(client, offline):
    """Short follow-ups skip the prefill leg (their decode replica holds the earlier prompt
    and answer); long ones go to the prefill replica holding the earlier prompt. Either way
    every full block of the earlier context is a cache hit."""
    assert wait_until(index_knows_all_engines, timeout_s=60)
    rng = random.Random(5)
    conversations = [[rng.randrange(10, 400) for _ in range(70)] for _ in range(6)]
    hit_share = []
    for turn in range(3):
        for i, prompt in enumerate(conversations):
            done = client.complete(generate_request(prompt, **PARAMS))
            check(done, prompt, offline)
            new = SHORT if i % 2 == 0 else LONG
            if turn == 0:
                assert done.route == "disaggregated"  # nothing cached anywhere yet
            elif new == SHORT:
                # The decode replica that wrote the earlier answer computed the tail itself.
                assert done.route == "decode_cached"
                earlier = len(prompt) - SHORT  # earlier prompt + answer (its KV but the last)
                hit_share.append(done.usage.cached_tokens / blocks(earlier - 1))
            else:
                # The prefill replica that ran the earlier prompt found it (cached_tokens:
                # the prefill leg's prefix hits).
                assert done.route == "disaggregated"
                earlier = len(prompt) - LONG - ANSWER_TOKENS
                hit_share.append(done.usage.cached_tokens / blocks(earlier))
            follow_up = [rng.randrange(10, 400) for _ in range(new)]
            conversations[i] = [*prompt, *done.token_ids, *follow_up]
        # Let the engines' events reach the index before the next turn.
        assert wait_until(index_knows_all_engines, timeout_s=10)
    assert len(hit_share) == 12 and min(hit_share) >= 1.0, hit_share


def test_engine_replicas_compute_on_cores_of_their_own(client):
    """As the kernel sees it: each engine replica's threads (all of them) on one core no other
    replica holds, as many replicas pinned as the machine has cores; the rest share."""
    import psutil

    # Ray titles a replica's process after its actor ("ray::ServeReplica:pdserve:...").
    titles = ("ray::ServeReplica:pdserve:PrefillServer", "ray::ServeReplica:pdserve:DecodeServer")
    engines = []
    for process in psutil.Process().children(recursive=True):  # this session's Ray's only
        with contextlib.suppress(psutil.Error):
            if process.cmdline() and process.cmdline()[0].startswith(titles):
                engines.append(process.pid)
    assert len(engines) == 4
    allowed = os.sched_getaffinity(0)
    pinned = []
    for engine in engines:
        masks = {
            frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{engine}/task")
        }
        assert len(masks) == 1, masks  # every thread alike
        (mask,) = masks
        if mask != allowed:
            assert len(mask) == 1
            pinned.append(next(iter(mask)))
    assert len(pinned) == min(4, len(allowed)) and len(set(pinned)) == len(pinned), pinned


def test_a_prefill_replica_borrows_the_turns_only_a_decode_replica_holds(client, offline):
    """Turn one is short (decode_cached: only its decode replica ever computed it); turn two is
    long, so a prefill replica runs it — holding turn zero's prompt alone. It borrows turn
    one's blocks from the decode replica over NIXL (a prefix loan) instead of recomputing
    them: its prompt hits exceed anything a prefill replica computed."""
    rng = random.Random(31)
    prompt = [rng.randrange(10, 400) for _ in range(70)]
    turns = []
    for new in (SHORT, LONG, None):
        done = client.complete(generate_request(prompt, **PARAMS))
        check(done, prompt, offline)
        turns.append((done, len(prompt)))
        if new is not None:
            prompt = [*prompt, *done.token_ids, *(rng.randrange(10, 400) for _ in range(new))]
        assert wait_until(index_knows_all_engines, timeout_s=10)
    (zero, zero_len), (one, one_len), (two, _) = turns
    assert (zero.route, one.route, two.route) == ("disaggregated", "decode_cached", "disaggregated")
    # Prefill replicas hold turn zero's prompt at most; the decode replica turn one's KV too.
    assert blocks(zero_len) < blocks(one_len + ANSWER_TOKENS - 1)
    assert two.usage.cached_tokens >= blocks(one_len + ANSWER_TOKENS - 1)


def holders(prompt: list[int], role: str) -> list[str]:
    """The replicas of `role` holding the whole prompt's full blocks (the one that served it)."""
    hashes = prompt_block_hashes(prompt, BLOCK)
    found = ray.get(index_actor().lookup.remote(hashes, role))
    return [replica for replica, held in found.items() if held.cached_blocks == len(hashes)]


def test_a_uniform_workload_is_spread_over_the_replicas(client, offline):
    """32 requests, 8 at a time, sharing a system prompt that one replica of each role holds
    when they start: the cache ranks that replica first, and the load in the score (queued
    prompt tokens, requests in flight) must still spread the work. Where each request ran is
    read from the index afterwards: its distinct blocks sit in exactly one replica of each
    role.

    The issue's bound (no replica over 2x the mean) cannot fail with two replicas, so this
    asserts a tighter one: each gets at least an eighth. Not an even split: the replicas do
    not compute at one speed here (two of the four engines pin a core each, the others share
    them with each other and with the suite's second worker), and where the cache ties, Serve
    rightly sends more to the replica with the shorter queue (seen in CI: 26 and 6). A cache
    that kept the work on its holder leaves the other replica next to nothing."""
    rng = random.Random(11)
    system = [rng.randrange(10, 400) for _ in range(2 * BLOCK)]
    prompts = [[*system, *(rng.randrange(10, 400) for _ in range(3 * BLOCK))] for _ in range(33)]
    warm_up, prompts = prompts[0], prompts[1:]
    check(client.complete(generate_request(warm_up, **PARAMS)), warm_up, offline)
    assert wait_until(index_knows_all_engines, timeout_s=10)
    for role in ("prefill", "decode"):
        assert len(holders(system, role)) == 1
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda p: client.complete(generate_request(p, **PARAMS)), prompts))
    for answer, prompt in zip(done, prompts, strict=True):
        check(answer, prompt, offline)
        assert answer.route == "disaggregated"
    assert wait_until(index_knows_all_engines, timeout_s=10)
    for role in ("prefill", "decode"):
        served = Counter()
        for prompt in prompts:
            (replica,) = holders(prompt, role)
            served[replica] += 1
        assert len(served) == 2 and min(served.values()) >= len(prompts) / 8, served


def roles() -> dict[str, str]:
    """Every engine replica's role, as the index knows it."""
    return {r: held.role for r, held in ray.get(index_actor().lookup.remote([])).items()}


def order(switches: dict[str, str]) -> None:
    """Order switches through the index, as its balancer does; wait until all are announced."""
    for replica, role in switches.items():
        ray.get(index_actor().order_switch.remote(replica, role))
    assert wait_until(lambda: switches.items() <= roles().items(), timeout_s=30)


def streamed(client: GenerationClient, prompt: list[int], params: dict, progress: list[int]):
    """The whole answer; `progress[0]` its tokens so far."""
    completion = Completion()
    for response in client.stream(generate_request(prompt, **params)):
        completion.add(response)
        progress[0] = len(completion.token_ids)
    return completion


def test_replicas_switch_roles_under_load_and_every_stream_ends_token_exact(
    served, client, offline
):
    """Both prefill replicas become decode replicas and a decode replica a prefill one while
    six long streams run: streams still running on a switched replica 0.2 s later move to
    another engine (migration), the rest finish where they are. Six new requests then
    prefill on the switched decode replica (through the decode deployment's handle) and
    decode on the other three. Every answer equals offline greedy; the replicas switch back;
    no block is held afterwards."""
    assert wait_until(index_knows_all_engines, timeout_s=30)
    # The engines brought the app's spec to the index: its balancer runs (and, with these
    # targets, moves nobody).
    policy = ray.get(index_actor().__ray_call__.remote(lambda index: index.roles.balancer.policy))
    assert policy.drain_timeout_s == 0.2 and policy.targets.tpot_s == 1e6
    before = roles()
    prefill = sorted(r for r, role in before.items() if role == "prefill")
    decode = sorted(r for r, role in before.items() if role == "decode")
    assert len(prefill) == len(decode) == 2
    rng = random.Random(41)
    long_params = {**PARAMS, "max_tokens": 300}
    first = [[rng.randrange(10, 400) for _ in range(70)] for _ in range(6)]
    progress = [[0] for _ in first]
    with ThreadPoolExecutor(6) as pool:
        running = [
            pool.submit(streamed, client, prompt, long_params, count)
            for prompt, count in zip(first, progress, strict=True)
        ]
        assert wait_until(lambda: min(n[0] for n in progress) >= 2, timeout_s=60)
        order({prefill[0]: "decode", prefill[1]: "decode", decode[0]: "prefill"})
        second = [[rng.randrange(10, 400) for _ in range(70)] for _ in range(6)]
        done = list(pool.map(lambda p: client.complete(generate_request(p, **PARAMS)), second))
        for prompt, future in zip(first, running, strict=True):
            expected = offline.generate(
                [{"prompt_token_ids": prompt}], SamplingParams(**long_params)
            )
            assert future.result().token_ids == expected[0].outputs[0].token_ids
    for answer, prompt in zip(done, second, strict=True):
        check(answer, prompt, offline)
        assert answer.route == "disaggregated"
    assert wait_until(index_knows_all_engines, timeout_s=10)
    # The only prefill replica now computed them (a prompt whose survey missed the index's
    # 100 ms goes to its role's own deployment, whose replicas all decode now: some may).
    placed = sum(holders(prompt, "prefill") == [decode[0]] for prompt in second)
    logger.info("%d of %d new prompts prefilled on the switched replica", placed, len(second))
    assert placed >= len(second) // 2
    for prompt in second:
        assert holders(prompt, "decode")[0] in (decode[1], *prefill)
    engines = {e.replica_id: e for e in client.health().engines}
    assert {engines[r].role_epoch for r in (*prefill, decode[0])} == {1}
    assert sum(e.moved_requests for e in engines.values()) >= 1  # the drain ran out for some
    order({prefill[0]: "prefill", prefill[1]: "prefill", decode[0]: "decode"})
    assert wait_until(served.engines_idle, timeout_s=60), client.health()


def test_the_index_is_complete_again_soon_after_its_actor_is_sigkilled(client, offline):
    """SIGKILL the index actor: Ray restarts it empty, and every engine's publisher (its call
    failing, or the new actor not knowing its replica) sends a snapshot. The index knows every
    engine again — the time from the actor's return is logged (Deliver 3 of the issue asks
    within 1 s) — and a follow-up finds its earlier context on the decode replica as before."""
    rng = random.Random(31)
    prompt = [rng.randrange(10, 400) for _ in range(70)]
    done = client.complete(generate_request(prompt, **PARAMS))
    check(done, prompt, offline)
    assert wait_until(index_knows_all_engines, timeout_s=10)
    dead = ray.get(index_actor().__ray_call__.remote(lambda _: os.getpid()))
    os.kill(dead, signal.SIGKILL)

    def answering() -> bool:
        """The actor runs again, in another process."""
        pid = ray.get(index_actor().__ray_call__.remote(lambda _: os.getpid()), timeout=5)
        return pid != dead

    assert wait_until(answering, timeout_s=60)
    returned = time.monotonic()
    assert wait_until(index_knows_all_engines, timeout_s=30, period_s=0.01)
    logger.info("index complete %.3f s after its actor returned", time.monotonic() - returned)
    follow_up = [*prompt, *done.token_ids, *(rng.randrange(10, 400) for _ in range(SHORT))]
    again = client.complete(generate_request(follow_up, **PARAMS))
    check(again, follow_up, offline)
    assert again.route == "decode_cached"
    assert again.usage.cached_tokens >= blocks(len(prompt) + ANSWER_TOKENS - 1)


def test_routing_survives_a_killed_and_restarted_replica(client, offline):
    """Kill a prefill replica: Serve starts another, the index forgets the dead one and learns
    the new one, and follow-ups keep finding their earlier prompts — those the survivor ran at
    once, those the dead one ran after one recomputation — with answers unchanged."""
    rng = random.Random(23)
    conversations = [[rng.randrange(10, 400) for _ in range(40)] for _ in range(6)]
    first = {}
    for i, prompt in enumerate(conversations):
        done = client.complete(generate_request(prompt, **PARAMS))
        check(done, prompt, offline)
        (first[i],) = holders(prompt, "prefill")
        conversations[i] = [
            *prompt,
            *done.token_ids,
            *(rng.randrange(10, 400) for _ in range(LONG)),
        ]
    victim = next(iter(Counter(first.values())))
    actors = replica_actors("PrefillServer")
    (victim_actor,) = [name for name in actors if name.endswith(f"#{victim}")]
    ray.kill(ray.get_actor(victim_actor, namespace="serve"), no_restart=True)

    def replaced() -> bool:
        running = replica_actors("PrefillServer")
        current = ray.get(index_actor().current.remote())
        return len(running) == 2 and victim_actor not in running and victim not in current

    assert wait_until(replaced, timeout_s=120)
    assert wait_until(index_knows_all_engines, timeout_s=60)
    for turn in range(2):
        for i, prompt in enumerate(conversations):
            done = client.complete(generate_request(prompt, **PARAMS))
            check(done, prompt, offline)
            assert done.route == "disaggregated"
            earlier = blocks(len(prompt) - LONG - ANSWER_TOKENS)
            if turn == 1 or first[i] != victim:
                assert done.usage.cached_tokens >= earlier, (turn, i)
            conversations[i] = [
                *prompt,
                *done.token_ids,
                *(rng.randrange(10, 400) for _ in range(LONG)),
            ]
        assert wait_until(index_knows_all_engines, timeout_s=10)
