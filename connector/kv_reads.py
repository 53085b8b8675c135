"""KVReads: the consuming side of the connector's worker — an engine's reads (a decode
engine's, or a prefill engine's of a prefix lent to it).

A read's life: handshake with the remote engine once (compatibility hash, transport
metadata), start the transport read, renew the lease while it runs (connector/read_watch.py),
release the lease when it ends, verify every block against its producer's checksum. Any
failure marks the read's local blocks invalid and says why (take_load_problems); the
scheduler applies the load-failure policy. How long a remote may stay silent is the
engine's `kv_transfer_config` (heartbeat_timeout_s, handshake_timeout_s, read_timeout_base_s).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from connector.kv_shards import ShardedLoad, ShardSet
from connector.metadata import ConnectorMetadata, LoadSpec, RemoteKV
from connector.read_watch import Doom, ReadWatch
from connector.side_channel_client import SideChannelClient, SideChannelError
from connector.transport import KVTransport
from engine.config import KVTransferConfig

logger = logging.getLogger(__name__)

_CLIENT_TIMEOUT_S = 10.0
# A remote that did not answer is not called again for this long (its loads fail at once).
_SILENT_S = 5.0
# Clients of silent remotes kept open for the reads that may still hold them.
_RETIRED_CLIENTS = 8
# A read's deadline grows with its bytes at a slow link's pace (config.read_timeout_base_s
# plus the bytes at this rate): a lost completion, a stuck transfer costs about a second.
READ_MIN_BYTES_PER_S = 100e6


@dataclass
class _ActiveRead:
    load: LoadSpec
    client: SideChannelClient
    deadline: float  # time.monotonic() by which the read is to have ended
    sharded: ShardedLoad  # its pieces (one, between engines of the same shard layout)
    cancelled: bool = False
    doom: Doom | None = None  # why the read watch gave up on it
    timed_out: bool = False  # cancelled at its deadline
    failure: str | None = None  # the first piece's failure (the read ends once all have)
    refused_by_remote: bool = False  # a piece was refused: the remote no longer held it

    @property
    def num_bytes(self) -> int:
        return self.sharded.num_bytes

    @property
    def unreachable(self) -> bool:
        """The remote stopped answering: no release is tried, the checksums decide."""
        return self.doom is not None and self.doom.unreachable

    @property
    def fenced(self) -> bool:
        """The remote answered that it no longer holds the blocks."""
        return self.doom is not None and not self.doom.unreachable

    def problem(self, refused_by_remote: bool) -> str:
        """Why it failed, in a word (KVConnectorBase.take_load_problems); `refused_by_remote`:
        the transport's remote refused it for blocks no longer held as lent."""
        if self.unreachable:
            return "unreachable"
        if self.fenced or refused_by_remote:
            return "fenced"
        return "timed_out" if self.timed_out else "failed"


class KVReads:
    """The reads of one engine, driven from its engine thread (the watch renews from its own)."""

    def __init__(
        self, config: KVTransferConfig, engine_id: str, compat_hash: str, transport: KVTransport
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.transport = transport
        self._clients: dict[tuple[str, int], SideChannelClient] = {}
        self._retired: list[SideChannelClient] = []  # of remotes found silent
        self._peers: set[str] = set()
        self._engine_at: dict[tuple[str, int], str] = {}  # the engine a side channel serves
        self._silent_until: dict[tuple[str, int], float] = {}  # remotes not to call for now
        self._active: dict[str, _ActiveRead] = {}
        self._pieces: dict[str, str] = {}  # transfer id -> the request id it is a piece of
        self._shard_heads: dict[str, tuple[tuple[int, int], ...]] = {}  # per remote engine
        # Leases renewed, silent remotes found, off the engine thread.
        self._watch = ReadWatch(timeout_s=config.heartbeat_timeout_s)
        self._finished_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._problems: dict[str, str] = {}  # request id -> why its load was not used in full
        self._shards: ShardSet | None = None
        self.stats = {
            "blocks_read": 0,
            "reads_failed": 0,
            "remote_engines": 0,
            "blocks_verified": 0,  # read blocks whose checksum matched
            "checksum_failures": 0,  # reads with a block that did not match
            "blocks_corrupted": 0,  # blocks that did not match (handled by the policy)
            "checksum_us_verified": 0,  # spent summing the blocks read, to check them
            "fenced_reads": 0,  # the remote no longer held the blocks: never used
            "unanswered_reads": 0,  # the remote stopped answering mid-read
            "timed_out_reads": 0,  # not reported done by their deadline
            # Reads' pieces (connector/kv_shards.py): straight into our shard's blocks, or
            # through staging (the remote shard holds other heads than ours).
            "pieces_direct": 0,
            "pieces_staged": 0,
        }

    def register(self, shards: ShardSet) -> None:
        self._shards = shards

    @property
    def in_flight(self) -> set[str]:
        """Request ids whose reads have started and not yet ended."""
        return set(self._active)

    def start(self, meta: ConnectorMetadata) -> None:
        for remote in meta.releases:
            self._release(remote)
        for request_id in meta.cancels:
            active = self._active.get(request_id)
            if active is not None and not active.cancelled:
                active.cancelled = True
                self._cancel_pieces(active)
        for load in meta.loads:
            self._start_load(load)

    def _start_load(self, load: LoadSpec) -> None:
        if self._is_silent(load.remote):
            # It did not answer a moment ago: no call to wait on, the policy takes over.
            self._failed(load, "unreachable")
            return
        renewing = False
        assert self._shards is not None, "register() first"
        try:
            client = self._client(load.remote)
            self._handshake(client, load.remote)
            heads = self._shard_heads.get(load.remote.engine_id, ())
            sharded = ShardedLoad.plan(load, self._shards, heads)  # ValueError: cannot map
            # One-sided transports (NIXL) read without asking the remote: make sure the lease
            # is live before reading (a refused renewal fails the load, nothing is read).
            renewing = True
            client.renew_lease(load.remote.lease_id, self.config.heartbeat_timeout_s)
            renewing = False
            failure = self._start_pieces(sharded)
            staged = sum(not piece.direct for piece in sharded.pieces)
            self.stats["pieces_staged"] += staged
            self.stats["pieces_direct"] += len(sharded.pieces) - staged
        except (SideChannelError, ValueError, RuntimeError) as exc:
            logger.warning("KV load for %s failed to start: %s", load.request_id, exc)
            if _unreachable(exc):
                self._mark_silent(load.remote)
                self._failed(load, "unreachable")
                return
            # Refused (layout mismatch, bad engine id, a read that could not be posted): the
            # remote holds the blocks for nobody now, so hand them back at once.
            self._release(load.remote)
            fenced = renewing and isinstance(exc, SideChannelError) and exc.lease_gone
            self._failed(load, "fenced" if fenced else "refused")
            return
        # Reads in flight share the link (and may be queued ahead in the transport): the
        # budget covers their bytes too.
        ahead = sum(a.num_bytes for a in self._active.values())
        budget = (
            self.config.read_timeout_base_s + (ahead + sharded.num_bytes) / READ_MIN_BYTES_PER_S
        )
        active = _ActiveRead(load, client, time.monotonic() + budget, sharded)
        active.failure, active.cancelled = failure, failure is not None
        self._active[load.request_id] = active
        for transfer_id in sharded.pending:
            self._pieces[transfer_id] = load.request_id
        self._watch.add(load.request_id, client, load.remote.lease_id)

    def _start_pieces(self, sharded: ShardedLoad) -> str | None:
        """Start every piece's read. Where a later one cannot start, those started are
        cancelled and why is returned: the load then fails once they have stopped (nothing
        writes into its blocks after that). Where the first cannot, the error is raised."""
        started: set[str] = set()
        for transfer_id, (_, read) in sharded.reads.items():
            try:
                self.transport.start_read(read)
            except (ValueError, RuntimeError) as exc:
                if not started:
                    raise
                for piece in started:
                    self.transport.cancel(piece)
                sharded.pending = started
                return f"a piece could not start: {exc}"
            started.add(transfer_id)
        return None

    def _client(self, remote: RemoteKV) -> SideChannelClient:
        key = (remote.host, remote.port)
        if key not in self._clients:
            self._clients[key] = SideChannelClient(
                remote.host, remote.port, self.config.secret, _CLIENT_TIMEOUT_S, self.config.tls
            )
        return self._clients[key]

    def _handshake(self, client: SideChannelClient, remote: RemoteKV) -> None:
        """Once per remote engine: check compatibility, learn how to read from it."""
        if remote.engine_id in self._peers:
            return
        reply = client.handshake(
            self.engine_id,
            self.compat_hash,
            self.transport.name,
            timeout_s=self.config.handshake_timeout_s,
        )
        if reply.engine_id != remote.engine_id:
            raise ValueError(
                f"side channel {remote.host}:{remote.port} is engine {reply.engine_id!r}, "
                f"not {remote.engine_id!r}"
            )
        set_client = getattr(self.transport, "set_remote_client", None)
        if set_client is not None:
            set_client(reply.engine_id, client)
        self.transport.add_remote(reply.engine_id, reply.transport_metadata)
        self._shard_heads[reply.engine_id] = reply.shard_heads
        self._peers.add(reply.engine_id)
        self._forget_replaced((remote.host, remote.port), reply.engine_id)
        self.stats["remote_engines"] = len(self._peers)

    def _forget_replaced(self, address: tuple[str, int], engine_id: str) -> None:
        """A new engine at an address another served (a restarted prefill engine): the old
        one is gone, so is what we held for it (its NIXL agent's metadata). Reads still
        posted to it end first (they fail: nothing answers)."""
        old = self._engine_at.get(address)
        self._engine_at[address] = engine_id
        if old is None or old == engine_id:
            return
        self._peers.discard(old)
        if any(a.load.remote.engine_id == old for a in self._active.values()):
            return
        forget = getattr(self.transport, "forget_remote", None)
        if forget is not None:
            forget(old)

    def get_finished(self) -> set[str]:
        """Request ids whose loads ended (used, or failed to the policy) since the last call."""
        # Reads that ended are taken first: only those still in flight may be cancelled.
        results = self.transport.poll()
        ended: list[_ActiveRead] = []
        for transfer_id in results.done:
            active = self._piece_ended(transfer_id, ended)
            if active is not None and active.failure is None:
                try:
                    active.sharded.landed(transfer_id)
                except (ValueError, RuntimeError, IndexError) as exc:  # shapes that do not fit
                    self._piece_failed(active, f"its blocks could not be placed: {exc}")
        for transfer_id, reason in results.failed.items():
            active = self._piece_ended(transfer_id, ended)
            if active is not None:
                self._piece_failed(active, reason)
                active.refused_by_remote |= transfer_id in results.fenced
        for active in ended:
            request_id = active.load.request_id
            self._pop_active(request_id)
            if active.failure is None:
                self._read_done(active)
                continue
            reason = active.doom.reason if active.doom is not None else active.failure
            logger.warning("KV load for %s failed: %s", request_id, reason)
            if not active.unreachable:
                self._release(active.load.remote)
            self._failed(active.load, active.problem(active.refused_by_remote))
        self._cancel_doomed()
        self._cancel_overdue()
        done, self._finished_recving = self._finished_recving, set()
        return done

    def _piece_ended(self, transfer_id: str, ended: list[_ActiveRead]) -> _ActiveRead | None:
        """The read `transfer_id` is a piece of; added to `ended` once its last piece ended."""
        request_id = self._pieces.pop(transfer_id, None)
        active = self._active.get(request_id) if request_id is not None else None
        if active is None:
            return None
        active.sharded.pending.discard(transfer_id)
        if not active.sharded.pending:
            ended.append(active)
        return active

    def _piece_failed(self, active: _ActiveRead, reason: str) -> None:
        """A piece failed: the load fails, so its other pieces stop (cancelled, not left to
        run out their deadline); it ends once they have."""
        if active.failure is None:
            active.failure = reason
            if not active.cancelled:
                active.cancelled = True
                self._cancel_pieces(active)

    def _cancel_pieces(self, active: _ActiveRead) -> None:
        for transfer_id in active.sharded.pending:
            self.transport.cancel(transfer_id)

    def _pop_active(self, request_id: str) -> _ActiveRead | None:
        self._watch.remove(request_id)
        return self._active.pop(request_id, None)

    def _read_done(self, active: _ActiveRead) -> None:
        """The transport wrote every block. They are used only if the remote still held them
        when the read ended (else they may have been rewritten while we read: fenced) and
        each matches its checksum. A remote that does not answer the release cannot say:
        then the checksums alone decide (they are of the blocks as handed off)."""
        live = None if active.unreachable else self._release(active.load.remote)
        if live is False or active.fenced:
            logger.warning(
                "KV load for %s: its blocks were rewritten or freed", active.load.request_id
            )
            self._failed(active.load, "fenced")
        else:
            self._verify(active.sharded)

    def _verify(self, sharded: ShardedLoad) -> None:
        """A read that ended well is used only if every block it wrote matches the checksum
        its producer computed (each piece summed what it brought as it landed); the blocks
        that do not are invalid (the policy then recomputes from the first of them, or fails
        the request). A remote null block stands for positions its attention never reads
        (left of a sliding window): its bytes are anyone's scratch, never checked."""
        load = sharded.load
        bad, num_checked = sharded.bad_blocks()
        self.stats["checksum_us_verified"] += sharded.checksum_us
        self.stats["blocks_read"] += len(load.local_block_ids)
        self.stats["blocks_verified"] += num_checked - len(bad)
        if bad:
            logger.warning(
                "KV load for %s: %d of %d blocks failed their checksum",
                load.request_id,
                len(bad),
                len(load.local_block_ids),
            )
            self.stats["checksum_failures"] += 1
            self.stats["blocks_corrupted"] += len(bad)
            self._invalid_block_ids.update(bad)
            self._problems[load.request_id] = "checksum"
        self._finished_recving.add(load.request_id)

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def has_pending(self) -> bool:
        return bool(self._active)

    def take_load_problems(self) -> dict[str, str]:
        problems, self._problems = self._problems, {}
        return problems

    def _failed(self, load: LoadSpec, problem: str) -> None:
        """Every block of the load is invalid; `problem` says why (take_load_problems)."""
        self.stats["reads_failed"] += 1
        self.stats["fenced_reads"] += problem == "fenced"
        self._problems[load.request_id] = problem
        self._invalid_block_ids.update(load.local_block_ids)
        self._finished_recving.add(load.request_id)

    def _cancel_doomed(self) -> None:
        """Cancel the reads the watch gave up on; the transport reports each once stopped."""
        for request_id, doom in self._watch.take_doomed().items():
            active = self._active.get(request_id)
            if active is None or active.cancelled:
                continue
            active.cancelled, active.doom = True, doom
            self.stats["unanswered_reads"] += doom.unreachable
            if doom.unreachable:
                self._mark_silent(active.load.remote)
            self._cancel_pieces(active)

    def _cancel_overdue(self) -> None:
        now = time.monotonic()
        for request_id, active in self._active.items():
            if not active.cancelled and now > active.deadline:
                logger.warning("KV load for %s timed out; cancelling", request_id)
                active.cancelled = active.timed_out = True
                self.stats["timed_out_reads"] += 1
                self._cancel_pieces(active)

    def _release(self, remote: RemoteKV) -> bool | None:
        """Give the lease back: True when it was still live, False when it had ended, None
        when the remote did not answer (it frees the blocks when the lease runs out)."""
        if self._is_silent(remote):
            return None
        try:
            return self._client(remote).release(remote.lease_id, self.config.heartbeat_timeout_s)
        except SideChannelError as exc:
            logger.info("releasing lease %s: %s", remote.lease_id, exc)
            if _unreachable(exc):
                self._mark_silent(remote)
                return None
            return False

    def _mark_silent(self, remote: RemoteKV) -> None:
        """No call to this remote for a while: the engine thread never waits on a silent
        remote once per load or release (each wait is up to a deadline). Its client is
        retired: the next call opens a new channel, which reads the TLS files again (a
        renewed certificate or CA) and reaches whatever engine serves that address now."""
        key = (remote.host, remote.port)
        self._silent_until[key] = time.monotonic() + _SILENT_S
        retired = self._clients.pop(key, None)
        if retired is not None:  # reads in flight may still hold it: closed later
            self._retired.append(retired)
            while len(self._retired) > _RETIRED_CLIENTS:
                self._retired.pop(0).close()

    def _is_silent(self, remote: RemoteKV) -> bool:
        return self._silent_until.get((remote.host, remote.port), 0.0) > time.monotonic()

    def close(self) -> None:
        self._watch.close()
        for client in [*self._clients.values(), *self._retired]:
            client.close()


def _unreachable(exc: Exception) -> bool:
    """The remote did not answer: a release would only wait for the same timeout."""
    return isinstance(exc, SideChannelError) and exc.code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
