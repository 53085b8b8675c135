"""The other replicas of the Router deployment, for what one router replica cannot do alone:
`Abort` of a request another replica holds (Serve's proxy sends the Abort call to any of them).

The Router deployment is routed by `request_routers.ReplicaSetRouter` (role "router"), which
publishes its replica set in every process holding a handle to it; this module holds one such
handle, to the Router's own deployment, and calls `abort_here` on each other replica by name
(a `ReplicaProbe`). The handle is made on first use: a router replica that never has to look
elsewhere never builds one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from deployments.cluster.replica_set import REPLICA_SETS, ReplicaSets
from deployments.protocol import ReplicaProbe

logger = logging.getLogger(__name__)

ROLE = "router"


class RouterPeers:
    def __init__(self, sets: ReplicaSets = REPLICA_SETS, timeout_s: float = 2.0) -> None:
        self._sets = sets
        self._timeout_s = timeout_s
        self._handle: Any = None
        self._self_id = ""

    async def abort(self, request_id: str) -> bool:
        """Whether another router replica held `request_id` (and aborted it). One replica
        after another: concurrent calls of one request to one deployment confuse Serve's
        routing (deployments/cluster/health.py says how)."""
        handle = await self._own_handle()
        # The handle's request router starts with its first call, then publishes the set:
        # make that call count (to any replica; this one answers False).
        unknown = self._sets.replica_ids(ROLE) is None
        if unknown and await self._ask(handle, "", request_id):
            return True
        for replica in await self._peer_ids():
            if await self._ask(handle, replica, request_id):
                return True
        return False

    async def _ask(self, handle: Any, replica: str, request_id: str) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                return bool(await handle.abort_here.remote(ReplicaProbe(replica), request_id))
        except Exception as exc:  # gone or restarting: it holds nothing of ours now
            logger.info("abort of %s on router replica %s: %r", request_id, replica, exc)
            return False

    async def _peer_ids(self) -> list[str]:
        """The other replicas, once the request router has published them (soon after the
        handle's first call)."""
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        while (ids := self._sets.replica_ids(ROLE)) is None:
            if asyncio.get_running_loop().time() > deadline:
                return []
            await asyncio.sleep(0.05)
        return [replica for replica in ids if replica != self._self_id]

    async def _own_handle(self) -> Any:
        if self._handle is None:
            from ray import serve

            context = serve.get_replica_context()
            self._self_id = context.replica_id.unique_id
            deployment, app = context.deployment, context.app_name
            # A blocking lookup (the controller): off the event loop.
            self._handle = await asyncio.to_thread(serve.get_deployment_handle, deployment, app)
        return self._handle
