"""The Router's side-channel calls to engines: giving leases back, borrowing prefixes.

- `LeaseReleaser` ends a prefill's lease when no decode engine will read it (the request was
  given up, or the client went away).
- `PrefixBorrower` asks the engine holding most of a prompt (a decode replica that wrote the
  earlier turns of a conversation, say) to lend those blocks under a lease (LendPrefix). The
  loan travels to the prefill leg as ordinary remote-prefill kv_transfer_params: the prefill
  engine reads the blocks (NIXL or gRPC, as any handed-off KV) and computes only the rest of
  the prompt — Dynamo users ask for exactly this (its issue #10449).

Calls are blocking gRPC with short deadlines, run off the event loop; a failed call forgets
the channel (a restarted replica listens elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from connector.metadata import RemoteKV, tokens_hash
from connector.side_channel_client import SideChannelClient, SideChannelError
from deployments.cluster.kv_scoring import CacheSurvey, lender_worth_borrowing
from engine.config import SideChannelTLS

logger = logging.getLogger(__name__)
T = TypeVar("T")
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class _Clients:
    """One side-channel client per engine address."""

    def __init__(self, secret: str, timeout_s: float, tls: SideChannelTLS | None) -> None:
        self.secret = secret
        self.timeout_s = timeout_s
        self.tls = tls
        self._clients: dict[tuple[str, int], SideChannelClient] = {}

    async def call(self, host: str, port: int, fn: Callable[[SideChannelClient], T]) -> T:
        key = (host, port)
        if key not in self._clients:
            self._clients[key] = SideChannelClient(
                host, port, self.secret, self.timeout_s, self.tls
            )
        try:
            return await asyncio.to_thread(fn, self._clients[key])
        except Exception as exc:
            # An engine that did not answer may have gone (a restarted one listens elsewhere);
            # one that refused is there.
            if not isinstance(exc, SideChannelError) or exc.code in _UNREACHABLE:
                client = self._clients.pop(key, None)
                if client is not None:
                    client.close()
            raise


class LeaseReleaser:
    """Ends a lease over its engine's side channel (the Orchestrator's ReleaseFn)."""

    def __init__(
        self, secret: str, timeout_s: float = 2.0, tls: SideChannelTLS | None = None
    ) -> None:
        self._clients = _Clients(secret, timeout_s, tls)

    async def __call__(self, kv_transfer_params: dict[str, Any]) -> None:
        remote = RemoteKV.from_params(kv_transfer_params)
        await self._clients.call(remote.host, remote.port, lambda c: c.release(remote.lease_id))


class PrefixBorrower:
    """Borrows a prompt's leading blocks for its prefill leg where that saves enough work."""

    def __init__(
        self,
        secret: str,
        block_size: int,
        min_tokens: int,
        timeout_s: float = 1.0,
        tls: SideChannelTLS | None = None,
    ) -> None:
        self._clients = _Clients(secret, timeout_s, tls)
        self.block_size = block_size
        # A loan must spare the prefill at least this many prompt tokens (a lease, a
        # handshake and a read cost about what computing a few blocks does).
        self.min_tokens = min_tokens

    async def borrow(self, prompt: list[int], survey: CacheSurvey | None) -> dict[str, Any] | None:
        """Remote-prefill kv_transfer_params for the lent blocks, or None (nothing worth
        borrowing, or the lender refused or did not answer: the prefill computes it all)."""
        lender = lender_worth_borrowing(survey, self.min_tokens)
        if survey is None or lender is None:
            return None
        host, _, port = lender.side_channel.rpartition(":")
        hashes = survey.block_hashes[: lender.tokens // self.block_size]
        try:
            reply = await self._clients.call(host, int(port), lambda c: c.lend_prefix(hashes))
        except Exception as exc:  # a loan is an optimisation: compute instead
            logger.info("borrowing a prefix from %s failed: %s", lender.side_channel, exc)
            return None
        if not reply.block_ids:
            return None
        num_tokens = len(reply.block_ids) * self.block_size
        return RemoteKV(
            engine_id=reply.engine_id,
            request_id=reply.request_id,
            block_ids=reply.block_ids,
            host=host,
            port=int(port),
            lease_id=reply.lease_id,
            num_tokens=num_tokens,
            tokens_hash=tokens_hash(prompt[:num_tokens]),
            block_checksums=reply.block_checksums,
        ).to_params()


ReleaseFn = Callable[[dict[str, Any]], Awaitable[None]]


class BackgroundReleases:
    """Leases given back in the background: a release never holds up (or fails) a response,
    and the lease expires anyway if it does not get through."""

    def __init__(self, release: ReleaseFn | None) -> None:
        self._release = release
        self._tasks: set[asyncio.Task[None]] = set()

    def soon(self, kv_transfer_params: dict[str, Any]) -> None:
        if self._release is None:
            return
        task = asyncio.get_running_loop().create_task(self._run(kv_transfer_params))
        self._tasks.add(task)  # a reference until done, or the task may vanish
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until every release sent has ended (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, kv_transfer_params: dict[str, Any]) -> None:
        assert self._release is not None
        try:
            await self._release(kv_transfer_params)
        except Exception as exc:  # best effort: the lease expires anyway
            logger.info("releasing prefill blocks: %r", exc)
