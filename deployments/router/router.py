"""Router: the app's ingress. gRPC `pdserve.v1.Generation` through Serve's gRPC proxy and the
OpenAI-compatible HTTP API through Serve's HTTP proxy, both over one Orchestrator.

The engine replicas are reached through Serve deployment handles (Serve picks the replica).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NoReturn

from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from deployments.cluster.health import (
    RUNNING,
    CachedHealth,
    HealthReport,
    Probe,
    ask_every_replica,
    survey,
)
from deployments.cluster.replica_set import REPLICA_SETS, RoleWatch
from deployments.credentials import ApiKeys, kv_secret, without_credentials
from deployments.errors import (
    Overloaded,
    Unauthenticated,
    engine_failure,
    public_message,
    status_of,
)
from deployments.protocol import (
    EngineRequest,
    ReplicaProbe,
    ResponseChunk,
    chunk_to_proto,
    input_from_proto,
)
from deployments.router.grpc_ingress import UndecodableRequest, quiet_client_errors
from deployments.router.kv_leases import LeaseReleaser, PrefixBorrower
from deployments.router.openai_api import build_openai_app
from deployments.router.orchestrator import (
    FlowConfig,
    ModelFacts,
    Orchestrator,
    StreamFn,
)
from deployments.router.peers import RouterPeers
from deployments.router.role_placement import RolePlacement
from deployments.router.telemetry import RouterMetrics, RouterTelemetry
from deployments.serve_context import replica_name
from deployments.telemetry import Tracing
from engine.config import SideChannelTLS
from engine.core.admission import QueueFull
from engine.inputs import InputProcessor
from engine.models.catalog import served_model_name
from engine.outputs import EngineCoreOutput
from protos.pdserve.v1 import generate_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass
class RouterSettings:
    """What a Router replica is built with: the app's settings (deployments/app_config.py AppConfig,
    where each has its default), resolved for the router."""

    model: str
    engine_args: dict[str, Any]
    flow: FlowConfig
    kv_secret: str  # or a reference to $PDSERVE_KV_SECRET (credentials.py)
    transport: str  # "" in colocated mode
    served_model_name: str
    otlp_endpoint: str
    kv_aware_routing: bool  # the engines publish to the app's KV index
    retry_after_s: float  # told to clients refused at an admission bound
    api_keys: ApiKeys  # salted digests only (credentials.py)
    side_channel_tls: SideChannelTLS | None  # to release and borrow KV over mTLS
    role_switching: bool = False  # engine replicas may switch roles (placement by the index)


@dataclass
class _InFlight:
    task: asyncio.Task[Any] | None
    aborted: bool = False


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        decode: DeploymentHandle,
        prefill: DeploymentHandle | None = None,
    ) -> None:
        # The router computes nothing: its copy of the engine's config only checks and
        # tokenizes prompts, on a node with no GPU ("cuda" would be refused here).
        inputs = InputProcessor.from_args(
            settings.model, **{**settings.engine_args, "device": "cpu"}
        )
        quiet_client_errors()  # refusals: one INFO line each in this replica's log
        self.settings = settings
        self.tokenizer = inputs.tokenizer
        self.facts = ModelFacts(
            name=settings.served_model_name or served_model_name(settings.model),
            max_model_len=inputs.max_model_len,
            vocab_size=inputs.arch.vocab_size,
        )
        self.block_size = inputs.config.cache.block_size
        self.kv_secret = kv_secret(settings.kv_secret)  # resolved on this node, once
        self._decode = decode
        self._prefill = prefill
        # The role of the engines every request reaches (a colocated app has no other).
        self._decode_role = "decode" if prefill is not None else "colocated"
        self._in_flight: dict[str, _InFlight] = {}
        self._peers = RouterPeers()
        self._health = CachedHealth(self._survey)
        self.tracing = Tracing("router", replica_name(), settings.otlp_endpoint)
        retry = settings.retry_after_s
        decode_fn = _stream_fn(decode, self._decode_role, retry)
        prefill_fn = _stream_fn(prefill, "prefill", retry) if prefill is not None else None
        placement = None
        if prefill_fn is not None and settings.role_switching:
            streams = {"prefill": prefill_fn, "decode": decode_fn}
            placement = RolePlacement(streams, REPLICA_SETS.replica_ids, self.block_size)
        self.orchestrator = Orchestrator(
            self.tokenizer,
            self.facts,
            settings.flow,
            decode=decode_fn,
            prefill=prefill_fn,
            placement=placement,
            release=LeaseReleaser(self.kv_secret, tls=settings.side_channel_tls),
            telemetry=RouterTelemetry(
                self.tracing.tracer, RouterMetrics(tuple(self._engine_handles()))
            ),
            prefill_replicas=RoleWatch("prefill") if prefill is not None else None,
            decode_replicas=RoleWatch(self._decode_role),
            **self._cluster_cache(settings, prefill is not None),
        )

    def _cluster_cache(self, settings: RouterSettings, disaggregated: bool) -> dict[str, Any]:
        """The engines' caches as the app's KV index sees them, where the engines publish to
        one: cache-aware disaggregation and prefix loans."""
        flow = settings.flow
        wanted = flow.max_local_prefill_tokens > 0 or flow.min_prefix_loan_tokens > 0
        wanted = wanted or settings.role_switching  # legs placed by the roles the index knows
        if not (disaggregated and settings.kv_aware_routing and wanted):
            return {}
        from deployments.cluster.kv_index import IndexedClusterCache

        app_name = serve.get_replica_context().app_name
        min_loan = flow.min_prefix_loan_tokens
        return {
            "cluster_cache": IndexedClusterCache(app_name, self.block_size),
            "borrower": PrefixBorrower(
                self.kv_secret,
                self.block_size,
                min_loan,
                tls=settings.side_channel_tls,
            ),
        }

    def __serve_build_asgi_app__(self) -> Any:
        return build_openai_app(
            lambda: self.orchestrator,
            self.facts.name,
            self.facts.max_model_len,
            self.health,
            self.settings.api_keys,
        )

    # ------------------------------------------------------------------ gRPC: pdserve.v1.Generation

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        carrier = self._authenticated(grpc_context)
        try:
            gen_input = input_from_proto(_decoded(request))
            if gen_input.request_id in self._in_flight:
                raise ValueError(f"request id {gen_input.request_id!r} is already in flight")
        except ValueError as exc:
            self.orchestrator.telemetry.rejected(carrier, str(exc))
            _refuse(grpc_context, exc)
        key = gen_input.request_id = gen_input.request_id or f"cmpl-{uuid.uuid4().hex}"
        record = _InFlight(asyncio.current_task())
        self._in_flight[key] = record
        last: ResponseChunk | None = None
        try:
            async with aclosing(self.orchestrator.generate(gen_input, carrier)) as chunks:
                async for chunk in chunks:
                    last = chunk
                    yield chunk_to_proto(chunk)
        except Exception as exc:  # an Overloaded's message says when to retry (Serve's proxy
            # drops trailing metadata of a failed call)
            if status_of(exc).internal:
                logger.exception("request %s failed", gen_input.request_id)
            _refuse(grpc_context, exc)
        except asyncio.CancelledError:
            if not record.aborted:
                raise
            # Our own Abort: end the stream normally, saying so.
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            yield chunk_to_proto(_aborted(gen_input.request_id, last))
        finally:
            self._in_flight.pop(key, None)

    async def Abort(
        self, request: pb.AbortRequest, grpc_context: RayServegRPCContext
    ) -> pb.AbortResponse:
        """Abort a request on whichever router replica holds it: this one, or each of the
        others in turn (the Router deployment's request router publishes them, and a probe
        naming one is routed to it alone)."""
        self._authenticated(grpc_context)
        request = _decoded_or_refuse(request, grpc_context)
        if await self.abort_here(None, request.request_id):
            return pb.AbortResponse(found=True)
        return pb.AbortResponse(found=await self._peers.abort(request.request_id))

    def _authenticated(self, grpc_context: RayServegRPCContext) -> dict[str, str]:
        """The call's metadata minus its credentials; UNAUTHENTICATED without a valid key."""
        metadata = dict(grpc_context.invocation_metadata())
        carrier = without_credentials(metadata)
        refusal = self.settings.api_keys.refusal(metadata.get("authorization"))
        if refusal is not None:
            self.orchestrator.telemetry.rejected(carrier, refusal, "unauthenticated")
            _refuse(grpc_context, Unauthenticated(refusal))
        return carrier

    async def abort_here(self, probe: ReplicaProbe | None, request_id: str) -> bool:
        """Abort `request_id` if this replica holds it (`probe` only steers the call here).
        A coroutine: it runs on the replica's event loop, where the task can be cancelled
        (Serve runs plain methods in a thread pool)."""
        record = self._in_flight.get(request_id)
        if record is None or record.task is None:
            return False
        record.aborted = True
        record.task.cancel()
        return True

    async def Health(
        self, request: pb.HealthRequest, grpc_context: RayServegRPCContext
    ) -> pb.HealthResponse:
        """Open to probes: a caller without a valid key (where the app has keys) gets the
        status alone, from a survey shared for a second; others every engine's figures, now."""
        _decoded_or_refuse(request, grpc_context)
        authorization = dict(grpc_context.invocation_metadata()).get("authorization")
        if self.settings.api_keys.refusal(authorization) is not None:
            return pb.HealthResponse(status=(await self.health(fresh=False)).status)
        report = await self.health()
        engines = [pb.EngineStats(**engine) for engine in report.engines]
        return pb.HealthResponse(status=report.status, engines=engines)

    async def health(self, fresh: bool = True) -> HealthReport:
        """Every replica of each engine role (deployments/cluster/health.py): surveyed now,
        or (`fresh` False: anonymous callers) the survey of the last second, shared."""
        return await (self._survey() if fresh else self._health.report())

    async def _survey(self) -> HealthReport:
        handles = self._engine_handles()
        return await survey(list(handles), REPLICA_SETS, _probe(handles, "stats"))

    def _engine_handles(self) -> dict[str, DeploymentHandle]:
        """The engine deployments by role."""
        if self._prefill is None:
            return {self._decode_role: self._decode}
        return {"prefill": self._prefill, self._decode_role: self._decode}

    async def StepTrace(
        self, request: pb.StepTraceRequest, grpc_context: RayServegRPCContext
    ) -> pb.StepTraceResponse:
        """Every engine replica's per-step scheduler trace (engine/core/step_trace.py)."""
        self._authenticated(grpc_context)
        request = _decoded_or_refuse(request, grpc_context)
        if not -1 <= request.keep_steps <= MAX_TRACE_STEPS:
            message = f"keep_steps must be -1, 0 or up to {MAX_TRACE_STEPS}"
            _refuse(grpc_context, ValueError(message))
        handles = self._engine_handles()
        # Each engine trims its answer to its share of what the proxies carry: the router
        # never holds more than about one answer's worth.
        known = sum(len(REPLICA_SETS.replica_ids(role) or [""]) for role in handles)
        share = STEP_TRACE_ANSWER_BYTES // max(1, known)
        call = _probe(handles, "step_trace", request.max_steps, request.keep_steps, share)
        # A whole ring takes a while to encode: more time than Health's probes.
        answers = await ask_every_replica(list(handles), REPLICA_SETS, call, timeout_s=10.0)
        engines = [_step_trace(answer) for answer in answers]
        _fit(engines, STEP_TRACE_ANSWER_BYTES)
        return pb.StepTraceResponse(engines=engines)

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelInfoResponse:
        self._authenticated(grpc_context)
        _decoded_or_refuse(request, grpc_context)
        return pb.ModelInfoResponse(
            model=self.facts.name,
            max_model_len=self.facts.max_model_len,
            vocab_size=self.facts.vocab_size,
            block_size=self.block_size,
            mode="colocated" if self._prefill is None else "disaggregated",
            transport=self.settings.transport,
        )


# What a StepTrace answer's records may take: within the 4 MiB the shipped gRPC proxies
# send or take (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE), with room for the rest of the message.
STEP_TRACE_ANSWER_BYTES = 3 << 20
# The most steps a StepTrace call may ask every engine to keep (a record is ~0.1-1 KB per
# request in the step): a bound on what tracing may hold in an engine.
MAX_TRACE_STEPS = 65536


def _probe(handles: dict[str, DeploymentHandle], method: str, *args: Any) -> Probe:
    """Calls of an engine method, each to the replica it names (any where it names none)."""

    async def probe(role: str, replica: str) -> dict[str, Any]:
        call = getattr(handles[role], method)
        return await call.remote(ReplicaProbe(replica) if replica else None, *args)

    return probe


def _step_trace(answer: dict[str, Any]) -> pb.EngineStepTrace:
    engine = pb.EngineStepTrace(role=answer["role"], replica_id=answer["replica_id"])
    if answer["state"] != RUNNING:
        engine.error = "the engine did not answer"
    else:
        engine.records.extend(answer["records"])
        engine.left_out = answer.get("left_out", 0)
        engine.error = answer.get("error", "")
    return engine


def _fit(engines: list[pb.EngineStepTrace], budget: int) -> None:
    """Leave out the oldest records, from the engine holding the most bytes first, until the
    records fit `budget` bytes; each engine counts what it lost (`left_out`)."""
    sizes = [[len(r) for r in e.records] for e in engines]
    held = [sum(s) for s in sizes]
    cut = [0] * len(engines)
    total = sum(held)
    while total > budget:
        i = max(range(len(engines)), key=held.__getitem__)
        size = sizes[i][cut[i]]
        cut[i] += 1
        held[i] -= size
        total -= size
    for engine, count in zip(engines, cut, strict=True):
        if count:
            del engine.records[:count]
            engine.left_out += count


def _stream_fn(handle: DeploymentHandle, role: str, retry_after_s: float = 1.0) -> StreamFn:
    """Calls to an engine deployment: its ValueErrors come back as ValueErrors, and any other
    failure as an EngineFailure whose message carries nothing of Ray's; a full engine (Serve's
    queue for the deployment, or the engine's own admission bound) is Overloaded."""
    streaming = handle.options(stream=True)

    async def stream(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        response: Any = streaming.generate.remote(request)  # a DeploymentResponseGenerator
        done = False
        try:
            async for chunk in response:
                yield chunk
            done = True
        except Exception as exc:
            cause = getattr(exc, "cause", None)  # RayTaskError: the replica's own exception
            if isinstance(cause, ValueError):
                raise ValueError(str(cause)) from None
            if isinstance(exc, BackPressureError) or isinstance(cause, QueueFull):
                message = f"the {role} engines are at capacity"
                raise Overloaded(message, retry_after_s) from None
            logger.warning("the %s leg failed", role, exc_info=True)
            raise engine_failure(role, exc) from None
        finally:
            if not done:
                # Aborts the request on the engine replica. For a call Serve never assigned
                # (back-pressure, a failed deployment) cancel() raises that error again: the
                # failure above is the one to report.
                try:
                    response.cancel()
                except Exception as exc:
                    logger.info("cancelling the %s leg's call: %r", role, exc)

    return stream


def _decoded(request: Any) -> Any:
    """The request message; ValueError for bytes Serve's proxy could not parse."""
    if isinstance(request, UndecodableRequest):
        raise ValueError(request.message)
    return request


def _decoded_or_refuse(request: Any, context: RayServegRPCContext) -> Any:
    try:
        return _decoded(request)
    except ValueError as exc:
        _refuse(context, exc)


def _refuse(context: RayServegRPCContext, exc: BaseException) -> NoReturn:
    """End the call with `exc`'s status (Serve's proxy keeps a code set before raising)."""
    context.set_code(status_of(exc).grpc_code)
    context.set_details(public_message(exc))
    raise exc


def _aborted(request_id: str, last: ResponseChunk | None) -> ResponseChunk:
    chunk = ResponseChunk(request_id=request_id, token_ids=[], text="", finish_reason="abort")
    if last is not None:
        chunk.route, chunk.ttft_s = last.route, last.ttft_s
    return chunk


RouterDeployment = serve.deployment(name="Router")(serve.ingress()(Router))
