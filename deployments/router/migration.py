"""Request migration: a generating leg whose engine fails goes on on another engine.

A decode replica that dies (SIGKILL, a lost node) or whose engine loop stops takes its streams
with it. Every engine can finish any request from its prompt and the tokens already generated
(`Request(output_token_ids=...)`: computed like a prompt, never sent again, sampling continuing
draw for draw because the sampler's randomness is counter-based), so the router resumes the
request elsewhere: another decode replica, or a prefill replica when no decode replica runs.
The client sees one stream, without a token lost or repeated.

Bounded: a request that fails `max_migrations` more times (a request that crashes every engine
it meets, a cluster with nothing left) ends with the last EngineFailure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from deployments.cluster.replica_set import ReplicaWatch
from deployments.errors import EngineFailure, Overloaded
from deployments.protocol import EngineRequest
from engine.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)

# A call to an engine deployment: its outputs for one EngineRequest.
StreamFn = Callable[[EngineRequest], AsyncGenerator[EngineCoreOutput, None]]


@dataclass(frozen=True)
class MigrationPolicy:
    max_migrations: int = 3  # per request; 0 turns migration off
    backoff_s: float = 0.1  # before the first retry, doubled for each one after it


@dataclass(frozen=True)
class Migration:
    """One move of a request to another engine (for its trace and metrics)."""

    attempt: int  # 1 for the first move
    target: str  # the role now serving it: "decode", "prefill" or "colocated"
    num_output_tokens: int  # generated before the move, computed again there
    reason: str


class ResumableLeg:
    """The outputs of one request's generating leg, continued on another engine when the one
    serving it fails. `outputs` holds every token the engines have generated for it so far;
    `first_attempt_chunks` how many outputs the original engine sent before it failed (0:
    it never took up the request's KV hand-off)."""

    def __init__(
        self,
        engines: MigrationTargets,
        request: EngineRequest,
        on_migration: Callable[[Migration], None] | None = None,
    ) -> None:
        self.engines = engines
        self.request = request
        self.on_migration = on_migration
        self.outputs: list[int] = list(request.output_token_ids)
        self.migrations = 0
        self.first_attempt_chunks = 0

    async def stream(self) -> AsyncGenerator[EngineCoreOutput, None]:
        request = self.request
        if self.engines.start is not None:  # a replica of another deployment, by hint
            role, stream_fn = self.engines.first_role, self.engines.start
        elif request.kv_transfer_params:
            # Its KV waits for a reader of the role it was handed to.
            role, stream_fn = self.engines.first_role, self.engines.first
        else:
            role, stream_fn = self.engines.next_target()
        while True:
            try:
                async with aclosing(self._attempt(stream_fn, request)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except (EngineFailure, Overloaded) as exc:
                if isinstance(exc, Overloaded) and self._refusable():
                    raise  # nothing sent yet: the client hears "at capacity" at once
                if self.migrations >= self.engines.policy.max_migrations:
                    if isinstance(exc, Overloaded):  # mid-stream: a failure, not a 429
                        raise EngineFailure(f"no engine could take the request on: {exc}") from None
                    raise
                self.migrations += 1
                logger.warning(
                    "request %s: the %s engine failed (%s); moving it with %d generated tokens",
                    self.request.request_id,
                    role,
                    exc,
                    len(self.outputs),
                )
                await asyncio.sleep(self.engines.policy.backoff_s * 2 ** (self.migrations - 1))
                role, stream_fn = self.engines.next_target()
                request = self._resumed()
                if self.on_migration is not None:
                    self.on_migration(Migration(self.migrations, role, len(self.outputs), str(exc)))

    async def _attempt(
        self, stream_fn: StreamFn, request: EngineRequest
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """One engine's outputs, under the original request id; an engine that reports an
        error, or a role that loses its last replica before the request's first output, is
        an EngineFailure (a reason to move)."""
        chunks = stream_fn(request)
        if stream_fn is self.engines.first and self.engines.can_fall_back:
            chunks = self.engines.unless_gone(chunks)
        async with aclosing(chunks) as outputs:
            async for chunk in outputs:
                if chunk.error is not None:
                    raise EngineFailure(f"an engine failed mid-request: {chunk.error}")
                if request is self.request:
                    self.first_attempt_chunks += 1
                else:
                    chunk = dataclasses.replace(chunk, request_id=self.request.request_id)
                self.outputs.extend(chunk.new_token_ids)
                yield chunk

    def _refusable(self) -> bool:
        """Whether the client has had nothing of this request yet (a decode leg that reads
        handed-off KV follows a first token the client has)."""
        return not (self.outputs or self.migrations or self.request.kv_transfer_params)

    def _resumed(self) -> EngineRequest:
        """The request again, from its prompt and every token generated so far: no KV to
        read (the engine computes them; its prefix cache may hold them), no replica hint,
        a new engine request id (the failed engine may still be aborting the old one)."""
        return dataclasses.replace(
            self.request,
            request_id=f"{self.request.request_id}-m{self.migrations}",
            kv_transfer_params=None,
            replica_hint="",
            output_token_ids=list(self.outputs),
            # The survey's holdings are from before the failure (or the role switch that
            # moved it): its router asks the index afresh.
            routing_holdings=None,
        )


class MigrationTargets:
    """Where a request's generating leg runs and may move: its own role's deployment, or, when
    none of its replicas runs, the prefill deployment (every engine can decode). A request
    starts there too when the role has no replica."""

    def __init__(
        self,
        first: StreamFn,
        first_role: str,
        policy: MigrationPolicy,
        replicas: ReplicaWatch | None = None,
        fallback: StreamFn | None = None,
        start: StreamFn | None = None,
    ) -> None:
        """`start`: where the first attempt goes instead of `first` (a replica that switched
        into the role from another deployment: router/role_placement.py)."""
        self.first = first
        self.start = start
        self.first_role = first_role
        self.policy = policy
        self.replicas = replicas
        self.fallback = fallback

    @property
    def can_fall_back(self) -> bool:
        """Whether there is a prefill deployment to go to and a watch to say when."""
        return self.fallback is not None and self.replicas is not None

    def next_target(self) -> tuple[str, StreamFn]:
        replicas, fallback = self.replicas, self.fallback
        if fallback is not None and replicas is not None and not replicas.available():
            return "prefill", fallback
        return self.first_role, self.first

    async def unless_gone(
        self, chunks: AsyncGenerator[EngineCoreOutput, None]
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """`chunks`, or an EngineFailure if the role loses its last replica before the first
        one arrives: Serve would hold the request until it starts another (seconds to
        minutes) while a prefill replica could serve it now."""
        assert self.replicas is not None, "only where can_fall_back"
        async with aclosing(chunks):
            first = asyncio.ensure_future(anext(chunks))
            gone = asyncio.ensure_future(self.replicas.gone())
            try:
                await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                # Also when this is cancelled (an abort): the stream cannot be closed while
                # a call into it is still running.
                gone.cancel()
                if not first.done():
                    first.cancel()
                    await asyncio.gather(first, return_exceptions=True)
            if first.cancelled():
                raise EngineFailure(f"no {self.first_role} replica is running")
            try:
                head = first.result()
            except StopAsyncIteration:
                return
            yield head
            async for chunk in chunks:
                yield chunk
