"""The router's request flow: tokenize once, prefill leg, stream the first token, decode leg.

Engines speak tokens only; the router owns the text side (response_stream.py), so a
disaggregated request reads exactly like a colocated one. Serve handles are wrapped into
`StreamFn`s by the router, which keeps this module free of Ray and testable over in-process
engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from deployments.cluster.kv_scoring import Borrower, CacheSurvey, ClusterCache, decode_holder
from deployments.cluster.replica_set import ReplicaWatch
from deployments.errors import DeadlineExceeded, Overloaded, RetryLater, Unavailable
from deployments.protocol import (
    ROUTE_CACHED,
    ROUTE_COLOCATED,
    ROUTE_DECODE_ONLY,
    ROUTE_DISAGGREGATED,
    ROUTE_FALLBACK,
    EngineRequest,
    GenerateInput,
    RequestLimits,
    ResponseChunk,
)
from deployments.router.kv_leases import BackgroundReleases, ReleaseFn
from deployments.router.leg_streams import answered_in_time, bounded, collect, drop_repeat
from deployments.router.migration import (
    Migration,
    MigrationPolicy,
    MigrationTargets,
    ResumableLeg,
    StreamFn,
)
from deployments.router.prompt_checks import check_length, context_max_tokens, tokenize_prompt
from deployments.router.response_stream import PreparedRequest, ResponseStream
from deployments.router.role_placement import RolePlacement
from deployments.router.telemetry import RouterTelemetry
from deployments.router.text_work import TextWork, prompt_chars
from engine.outputs import EngineCoreOutput, merge_outputs
from engine.request import FinishReason, SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

OnMigration = Callable[[Migration], None]


@dataclass(frozen=True)
class ModelFacts:
    """What the router needs to know about the model to validate and tokenize."""

    name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class FlowConfig:
    # Prompts with fewer tokens skip the prefill leg (the decode replica computes them).
    min_remote_prefill_tokens: int = 0
    request_timeout_s: float = 300.0
    # A prefill leg slower than this is given up for decode-only (e.g. no prefill replica).
    prefill_timeout_s: float = 60.0
    # Cache-aware disaggregation: a prompt of which the chosen decode replica holds all but
    # at most this many tokens skips the prefill leg (the decode replica computes the tail;
    # moving the whole prompt's KV would cost more). Needs a ClusterCache; 0 turns it off.
    max_local_prefill_tokens: int = 128
    # Prefix loans: the prefill leg borrows a prompt's leading blocks from the engine holding
    # the most of it when that spares it at least this many tokens. Needs a ClusterCache and
    # a Borrower; 0 turns it off.
    min_prefix_loan_tokens: int = 64
    # A decode (or colocated) leg whose engine fails goes on elsewhere (migration.py).
    migration: MigrationPolicy = field(default_factory=MigrationPolicy)
    limits: RequestLimits = field(default_factory=RequestLimits)
    # With no engine replica running (models loading, GPU nodes joining), a request is refused
    # at once, told to retry after this long, rather than held in Serve's queue. Off (None)
    # where an engine deployment may scale to zero: there the queued request is the demand
    # that makes Serve start one.
    retry_while_starting_s: float | None = 1.0


class Orchestrator:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        model: ModelFacts,
        config: FlowConfig,
        decode: StreamFn,
        prefill: StreamFn | None = None,
        release: ReleaseFn | None = None,
        telemetry: RouterTelemetry | None = None,
        prefill_replicas: ReplicaWatch | None = None,
        decode_replicas: ReplicaWatch | None = None,
        cluster_cache: ClusterCache | None = None,
        borrower: Borrower | None = None,
        placement: RolePlacement | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.decode = decode
        self.prefill = prefill
        self._releases = BackgroundReleases(release)  # leases no decode engine will read
        self.telemetry = telemetry or RouterTelemetry()
        self.prefill_replicas = prefill_replicas
        # With none of these running, a failed decode leg moves to a prefill replica.
        self.decode_replicas = decode_replicas
        self.cluster_cache = cluster_cache
        self.borrower = borrower
        self.placement = placement  # legs to replicas that switched roles
        self.text_work = TextWork()  # heavy text work, off the event loop

    # ------------------------------------------------------------------ validation

    def prepare(self, request: GenerateInput, received: float | None = None) -> PreparedRequest:
        """Tokenize and validate; ValueError for anything the engines would refuse. The
        request's time runs from `received` (default: now)."""
        self.config.limits.check(request)  # before any work that grows with the request
        text, token_ids = tokenize_prompt(self.tokenizer, self.model.vocab_size, request.prompt)
        params = request.params  # stop strings without a tokenizer: ResponseStream refuses
        if request.fill_context:
            max_tokens = context_max_tokens(self.model.max_model_len, len(token_ids))
            params = dataclasses.replace(params, max_tokens=max_tokens)
        check_length(len(token_ids), params.max_tokens, self.model.max_model_len)
        if self.prefill is not None and params.seed is None and not params.is_greedy:
            # Both legs must draw the first token alike: counter-based sampling needs a seed.
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        now = time.monotonic() if received is None else received
        timeout = request.timeout_s or self.config.request_timeout_s
        return PreparedRequest(
            request_id=request.request_id or f"cmpl-{uuid.uuid4().hex}",
            engine_request_id=uuid.uuid4().hex,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            priority=request.priority,
            cache_salt=request.cache_salt,
            started=now,
            deadline=now + timeout,
            pin=request.pin,
        )

    # ------------------------------------------------------------------ the flow

    async def generate(
        self, request: GenerateInput, trace_carrier: Mapping[str, str] | None = None
    ) -> AsyncGenerator[ResponseChunk, None]:
        """Validate, then stream the response; ValueError before the first chunk for bad input.
        DeadlineExceeded when the request runs out of time (the engines abort it).
        `trace_carrier` (gRPC metadata, HTTP headers) may hold the client's trace context."""
        observed = self.telemetry.observe(trace_carrier)
        try:
            self._check_engines_running()
            # Rendering and tokenizing cost time in proportion to the prompt (the tokenizer
            # releases the GIL in a worker thread).
            received = time.monotonic()
            cost = prompt_chars(request.prompt)
            prepared = await self.text_work.run(cost, self.prepare, request, received)
            observed.started(
                prepared.request_id,
                self.model.name,
                prepared.params,
                len(prepared.prompt_token_ids),
            )
            prepared.trace_context = observed.carrier() or None
            async with aclosing(self._generate(prepared, observed.migrated)) as chunks:
                async for chunk in chunks:
                    if chunk.finish_reason is not None:
                        chunk.migrations = observed.migrations  # the client may see it
                    observed.chunk(chunk)
                    yield chunk
        except ValueError as exc:
            observed.failed("invalid", str(exc))
            raise
        except DeadlineExceeded as exc:
            observed.failed("timeout", str(exc))
            raise
        except RetryLater as exc:
            observed.failed(
                "unavailable" if isinstance(exc, Unavailable) else "overloaded", str(exc)
            )
            raise
        except Exception as exc:
            observed.failed("error", str(exc))
            raise
        finally:
            observed.end()

    def _check_engines_running(self) -> None:
        """Unavailable when the routers have seen no running replica of any engine role. A role
        not watched, or not seen yet (no call made), counts as running: its first call finds
        out."""
        retry_after_s = self.config.retry_while_starting_s
        watches = [self.decode_replicas] + ([self.prefill_replicas] if self.prefill else [])
        if retry_after_s is None or any(w is None or w.available() for w in watches):
            return
        raise Unavailable(
            "no engine replica is running yet: the model is loading or its replicas are starting",
            retry_after_s,
        )

    async def _generate(
        self, prepared: PreparedRequest, on_migration: OnMigration | None = None
    ) -> AsyncGenerator[ResponseChunk, None]:
        stream = ResponseStream(self.tokenizer, prepared, self.text_work)
        decode_leg = functools.partial(self._decode_leg, on_migration=on_migration)
        if self.prefill is None:
            source = decode_leg(prepared, stream, ROUTE_COLOCATED)
        elif len(prepared.prompt_token_ids) < max(1, self.config.min_remote_prefill_tokens):
            source = decode_leg(prepared, stream, ROUTE_DECODE_ONLY)
        elif not _running(self.prefill_replicas) or not _running(self.decode_replicas):
            # No prefill replica runs (killed, restarting): decode-only now, not once Serve
            # has started another. No decode replica: one prefill replica does it all.
            source = decode_leg(prepared, stream, ROUTE_FALLBACK)
        else:
            survey = None
            if self.cluster_cache is not None:
                prompt, salt = prepared.prompt_token_ids, prepared.cache_salt
                survey = await self.cluster_cache.survey(prompt, salt)
                prepared.holdings = survey.holdings if survey is not None else None
            limit = self.config.max_local_prefill_tokens
            if hint := decode_holder(survey, len(prepared.prompt_token_ids), limit):
                source = decode_leg(prepared, stream, ROUTE_CACHED, replica_hint=hint)
            else:
                source = self._disaggregated(prepared, stream, survey, on_migration)
        async with aclosing(source) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _disaggregated(
        self,
        prepared: PreparedRequest,
        stream: ResponseStream,
        survey: CacheSurvey | None,
        on_migration: OnMigration | None = None,
    ) -> AsyncGenerator[ResponseChunk, None]:
        prompt = prepared.prompt_token_ids
        loan = await self.borrower.borrow(prompt, survey) if self.borrower else None
        first = await self._prefill_leg(prepared, loan)
        if first is None:  # the prefill leg failed: the decode replica computes the prompt
            fallback = self._decode_leg(prepared, stream, ROUTE_FALLBACK, on_migration=on_migration)
            async with aclosing(fallback) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        handed_off = first.kv_transfer_params
        stream.route = ROUTE_DISAGGREGATED
        stream.num_cached_tokens = first.num_cached_tokens
        only_token = prepared.params.max_tokens == 1 or first.finish_reason != FinishReason.LENGTH
        leg: ResumableLeg | None = None
        try:
            for chunk in await stream.feed_async(first, "prefill", final=only_token):
                yield chunk
            if stream.finished or handed_off is None:
                return
            # The token already sent is forced: the decode engine takes it with the whole
            # prompt's KV and continues from there, as colocated would (where it must compute
            # the last prompt token again, its sample is still that token: the legs never
            # fork). The decode stream repeats it first; the repeat is dropped.
            sent = list(first.new_token_ids)
            params = dataclasses.replace(prepared.params, forced_output_token_ids=sent)
            request = self._engine_request(prepared, params, handed_off)
            start = self._placed("decode", prepared, request)
            leg = self._resumable(request, on_migration, start=start)
            pending = list(sent)
            async with aclosing(bounded(leg.stream(), prepared)) as chunks:
                async for engine_chunk in chunks:
                    engine_chunk = drop_repeat(engine_chunk, pending)
                    for chunk in await stream.feed_async(engine_chunk, "decode"):
                        yield chunk
                    if stream.finished:
                        return
        finally:
            # A decode engine that produced anything has read (or given up on) the KV and
            # released the prefill blocks; otherwise nobody will (a migrated leg computes the
            # prompt again): release them here.
            if handed_off is not None and (leg is None or leg.first_attempt_chunks == 0):
                self._releases.soon(handed_off)

    async def _prefill_leg(
        self, prepared: PreparedRequest, loan: dict[str, Any] | None = None
    ) -> EngineCoreOutput | None:
        """The prefill's single chunk (first token + kv_transfer_params), or None on failure:
        an error, no answer within prefill_timeout_s, or no prefill replica left running while
        the request waited for one. A `loan` (remote-prefill params for blocks another engine
        lent) is read by the prefill engine instead of recomputed."""
        assert self.prefill is not None
        chunks: list[EngineCoreOutput] = []
        request = self._prefill_request(prepared, loan)
        stream = self._placed("prefill", prepared, request) or self.prefill
        leg = asyncio.ensure_future(collect(stream(request), chunks))
        completed = False
        try:
            completed = await answered_in_time(
                leg, prepared, self.config.prefill_timeout_s, self.prefill_replicas
            )
            if not completed:
                return None
        except Overloaded:
            raise  # the engines are full: decode-only would only add to it
        except ValueError as exc:
            if loan is None:
                raise  # the request itself is bad: decode-only would refuse it too
            # Maybe the loan was refused, not the request: decode-only tells them apart.
            logger.warning("prefill leg of %s refused (%s); decode-only", prepared.request_id, exc)
            return None
        except Exception as exc:  # replica gone, engine failed: fall back
            logger.warning("prefill leg of %s failed (%r); decode-only", prepared.request_id, exc)
            return None
        finally:
            leg.cancel()
            # Closing the leg's stream cancels the Serve call (and aborts the engine request).
            await asyncio.gather(leg, return_exceptions=True)
            if not completed:
                self._release_unread(chunks, loan)
        if not chunks or chunks[-1].error is not None or not chunks[-1].new_token_ids:
            logger.warning("prefill of %s ended without a token; decode-only", prepared.request_id)
            return None
        return functools.reduce(merge_outputs, chunks)

    def _prefill_request(
        self, prepared: PreparedRequest, loan: dict[str, Any] | None
    ) -> EngineRequest:
        """One token, and KV held for the decode engine (unless that one token is all)."""
        max_tokens = prepared.params.max_tokens
        params = dataclasses.replace(
            prepared.params, max_tokens=1, min_tokens=min(prepared.params.min_tokens, 1)
        )
        kv = {**(loan or {}), **({"do_remote_decode": True} if max_tokens > 1 else {})}
        return self._engine_request(prepared, params, kv or None)

    def _release_unread(self, chunks: list[EngineCoreOutput], loan: dict[str, Any] | None) -> None:
        """A prefill leg we stopped listening to: KV its engine holds for a reader, and a loan
        it may never have read, go back now rather than when their leases expire."""
        handed_off = chunks[-1].kv_transfer_params if chunks else None
        if handed_off is not None:
            self._releases.soon(handed_off)
        if loan is not None:
            self._releases.soon(loan)

    async def _decode_leg(
        self,
        prepared: PreparedRequest,
        stream: ResponseStream,
        route: str,
        replica_hint: str = "",
        on_migration: OnMigration | None = None,
    ) -> AsyncGenerator[ResponseChunk, None]:
        stream.route = route
        role = "colocated" if route == ROUTE_COLOCATED else "decode"
        request = self._engine_request(prepared, prepared.params, None)
        request.replica_hint = replica_hint
        start = None
        if replica_hint and self.placement is not None:
            start = self.placement.of(role, replica_hint).stream
        leg = self._resumable(request, on_migration, role, start)
        async with aclosing(bounded(leg.stream(), prepared)) as chunks:
            async for engine_chunk in chunks:
                if not leg.migrations:  # a moved request's cache hits are not the prompt's
                    stream.num_cached_tokens = engine_chunk.num_cached_tokens
                for chunk in await stream.feed_async(engine_chunk, role):
                    yield chunk
                if stream.finished:
                    return

    def _resumable(
        self,
        request: EngineRequest,
        on_migration: OnMigration | None,
        role: str = "decode",
        start: StreamFn | None = None,
    ) -> ResumableLeg:
        """The generating leg's outputs, moved to another engine if the one serving it fails:
        another replica of its role, or a prefill replica when none of those runs."""
        targets = MigrationTargets(
            self.decode, role, self.config.migration, self.decode_replicas, self.prefill, start
        )
        return ResumableLeg(targets, request, on_migration)

    def _placed(
        self, role: str, prepared: PreparedRequest, request: EngineRequest
    ) -> StreamFn | None:
        """Another deployment's call when the leg's replica switched into `role` from there
        (the request then names it), else None: the role's own deployment."""
        if self.placement is None:
            return None
        placed = self.placement.place(role, prepared.holdings, len(prepared.prompt_token_ids))
        if placed.stream is not None:
            request.replica_hint = placed.replica_hint
        return placed.stream

    def _engine_request(
        self, prepared: PreparedRequest, params: SamplingParams, kv: dict[str, Any] | None
    ) -> EngineRequest:
        # Stop strings are applied here, on text: engines only see tokens.
        return EngineRequest(
            request_id=prepared.engine_request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            params=dataclasses.replace(params, stop=()),
            priority=prepared.priority,
            cache_salt=prepared.cache_salt,
            kv_transfer_params=kv,
            trace_context=prepared.trace_context,
            # The engine that ends the turn holding all of it keeps it: not one handing off.
            pin=None if kv and kv.get("do_remote_decode") else prepared.pin,
            routing_holdings=prepared.holdings,
        )

    async def wait_background(self) -> None:
        """Wait for background releases (shutdown, tests)."""
        await self._releases.wait()


def _running(replicas: ReplicaWatch | None) -> bool:
    return replicas is None or replicas.available()
