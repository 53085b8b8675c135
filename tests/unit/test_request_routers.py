"""The engine deployments' request routers never pair a decode request with an engine that
cannot read the KV it brings: the producer's compatibility hash (in its kv_transfer_params)
against each replica's (Serve's replica metadata, EngineServer.record_replica_metadata).

Serve's RunningReplica is built from a live replica actor, so replicas here are stand-ins with
the two attributes the routers read (`replica_id.unique_id`, `replica_metadata`); the routers,
PendingRequest and the request are Serve's and pdserve's own."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest

from connector.metadata import RemoteKV, producer_compat_hash
from deployments.cluster.request_routers import KV_COMPAT_HASH, KVAwareRouter, ReplicaSetRouter
from deployments.protocol import EngineRequest
from engine.request import SamplingParams

DEPLOYMENT = DeploymentID(name="DecodeServer", app_name="pdserve")


@dataclass(frozen=True)
class ReplicaId:
    unique_id: str  # hashable, as Serve's ReplicaID: the routers key queue lengths by it


def replica(name: str, compat_hash: str | None) -> Any:
    metadata = {} if compat_hash is None else {KV_COMPAT_HASH: compat_hash}
    return SimpleNamespace(replica_id=ReplicaId(name), replica_metadata=metadata)


def remote_kv(compat_hash: str) -> dict[str, Any]:
    return RemoteKV(
        engine_id="prefill-1",
        request_id="r",
        block_ids=[3, 4],
        host="10.0.0.1",
        port=5000,
        lease_id="lease",
        num_tokens=20,
        tokens_hash="0" * 64,
        block_checksums=["1" * 16, "2" * 16],
        compat_hash=compat_hash,
    ).to_params()


def route(
    router_class: type, candidates: list[Any], request: EngineRequest, role: str = "decode"
) -> list[list[str]]:
    """The router's ranks of replica names for `request`. Each choice here is of replicas that
    may be full: the router must have told Serve to back off before asking again."""

    async def choose() -> list[list[Any]]:
        router = router_class(
            deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN
        )
        router.initialize_state(role=role)
        pending = PendingRequest(
            args=[request], kwargs={}, metadata=RequestMetadata("req", "internal")
        )
        chosen = await router.choose_replicas(candidates, pending)
        assert pending.routing_context.should_backoff
        return chosen

    ranks = asyncio.run(choose())
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


def decode_request(kv: dict[str, Any], hint: str = "") -> EngineRequest:
    # Shorter than a block: the KV-aware router's cache says nothing, load decides.
    return EngineRequest(
        "r", [1, 2, 3], SamplingParams(max_tokens=4), kv_transfer_params=kv, replica_hint=hint
    )


def test_kv_transfer_params_carry_the_producers_compatibility_hash() -> None:
    params = remote_kv("abc")
    assert producer_compat_hash(params) == "abc"
    assert RemoteKV.from_params(params).compat_hash == "abc"
    assert producer_compat_hash({"do_remote_decode": True}) == ""
    assert producer_compat_hash(None) == ""


def test_a_decode_request_goes_only_to_engines_that_can_read_its_kv() -> None:
    # d has no metadata (an engine of an older pdserve, say): it is not known to be able to.
    candidates = [replica("a", "x"), replica("b", "y"), replica("c", "x"), replica("d", None)]
    for router_class in (ReplicaSetRouter, KVAwareRouter):
        (rank,) = route(router_class, candidates, decode_request(remote_kv("x")))
        assert rank == ["a", "c"], router_class
        # One compatible replica: it alone, whatever the load.
        (rank,) = route(router_class, candidates, decode_request(remote_kv("y")))
        assert rank == ["b"], router_class


def test_a_hint_for_an_engine_that_cannot_read_the_kv_is_not_followed() -> None:
    candidates = [replica("a", "x"), replica("b", "y")]
    for router_class in (ReplicaSetRouter, KVAwareRouter):
        assert route(router_class, candidates, decode_request(remote_kv("x"), "a")) == [["a"]]
        # Cache-aware disaggregation chose b, which cannot read it: a does the decode.
        assert route(router_class, candidates, decode_request(remote_kv("x"), "b")) == [["a"]]


def test_with_no_compatible_engine_every_engine_stays_a_candidate() -> None:
    """None can read the KV: the request still gets an engine, whose handshake refuses the
    pairing; the engine recomputes the prompt (or fails it under policy "fail")."""
    candidates = [replica("a", "y"), replica("b", "z")]
    (rank,) = route(KVAwareRouter, candidates, decode_request(remote_kv("x"), "b"))
    assert rank == ["b"]  # the hint, among all of them


def test_the_kv_aware_router_ranks_by_the_holdings_the_request_carries() -> None:
    """The Router's survey asked the index already: the leg's router ranks its candidates by
    the holdings the request carries (no index here: asking it would leave load to decide),
    and the holdings never travel with the request to an engine."""
    import pickle

    from deployments.cluster.kv_scoring import Holding
    from engine.core.kv_events import EngineLoad

    idle = EngineLoad(num_running=0, num_waiting=0, queued_prompt_tokens=0, kv_cache_usage=0.1)
    holdings = {"a": Holding(0, idle), "b": Holding(4, idle), "p": Holding(6, idle, "prefill")}
    request = EngineRequest("r", list(range(100)), SamplingParams(max_tokens=4))
    request.routing_holdings = holdings
    candidates = [replica(name, None) for name in ("a", "b", "c")]
    assert route(KVAwareRouter, candidates, request) == [["b"], ["a", "c"]]
    assert pickle.loads(pickle.dumps(request)).routing_holdings is None


def test_replicas_that_switched_roles_leave_their_deployment_s_candidates() -> None:
    """A decode replica now in the prefill role (deployments/cluster/role_balance.py) gets no
    decode leg from its deployment's router, and a prefill replica now decoding no prefill
    leg; a replica whose role the index does not know stays; where none is in the role, all
    stay (a decode leg sent to the prefill deployment when no decode replica runs)."""
    from deployments.cluster.kv_scoring import Holding
    from engine.core.kv_events import EngineLoad

    idle = EngineLoad(num_running=0, num_waiting=0, queued_prompt_tokens=0, kv_cache_usage=0.1)
    holdings = {
        "a": Holding(2, idle, "decode"),
        "b": Holding(5, idle, "prefill"),  # switched
        "c": Holding(1, idle, "decode"),
    }
    candidates = [replica(name, None) for name in ("a", "b", "c", "u")]

    def leg(kv: dict[str, Any] | None) -> EngineRequest:
        request = EngineRequest("r", list(range(100)), SamplingParams(max_tokens=4))
        request.kv_transfer_params = kv
        request.routing_holdings = holdings
        return request

    assert route(KVAwareRouter, candidates, leg(None)) == [["a"], ["c"], ["u"]]
    prefill_leg = leg({"do_remote_decode": True})
    assert route(KVAwareRouter, candidates, prefill_leg, role="prefill") == [["b"], ["u"]]
    none_decoding = leg(None)
    none_decoding.routing_holdings = {"b": holdings["b"], "e": Holding(0, idle, "prefill")}
    two = [replica("b", None), replica("e", None)]
    assert route(KVAwareRouter, two, none_decoding) == [["b"], ["e"]]


def test_a_prefill_leg_s_loan_is_what_its_router_counts_as_cached_everywhere() -> None:
    from deployments.cluster.request_routers import _lent_blocks

    loan = {**remote_kv("x"), "do_remote_decode": True}  # remote_num_tokens 20
    assert _lent_blocks(loan, 16) == 1
    assert _lent_blocks(remote_kv("x"), 16) == 0  # a decode leg's hand-off: not a loan
    assert _lent_blocks({"do_remote_decode": True}, 16) == 0
    assert _lent_blocks(None, 16) == 0
