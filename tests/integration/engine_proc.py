"""An LLM engine in its own process, driven over a pipe (real processes for KV transfer)."""

from __future__ import annotations

import contextlib
import threading
import traceback
from typing import Any

import torch

from engine.request import SamplingParams
from tests.integration.processes import peer_context

_START_TIMEOUT_S = 120
_HOLD_TIMEOUT_S = 60  # a held read goes on by itself after this (a test that failed)


def _summary(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "kv_transfer_params": output.kv_transfer_params,
        "error": output.error,
        "num_cached_tokens": output.num_cached_tokens,
        "adopted_first_token": bool(output.timing and output.timing.kv_load_adopted_first_token),
    }


def _state(llm: Any) -> dict[str, Any]:
    engine = llm.engine
    manager = engine.scheduler.kv_cache_manager
    try:
        manager.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = f"broken: {exc}"
    return {
        "integrity": integrity,
        "free_blocks": manager.block_pool.get_num_free_blocks(),
        "usable_blocks": engine.num_kv_blocks,
        "unfinished": engine.scheduler.get_num_unfinished_requests(),
        "held_requests": len(engine.scheduler.requests),
        "stats": engine.kv_transfer_stats(),
    }


def _serve(conn: Any, model: str, engine_kwargs: dict[str, Any]) -> None:
    from engine.llm import LLM

    llm = LLM(model, **engine_kwargs)
    connector = llm.engine.connector
    gate = threading.Event()  # held ReadBlocks streams go on once it is set
    held: list[int] = []  # block ids of the chunks waiting on the gate
    conn.send(("ready", llm.engine.side_channel_port))
    while True:
        command, args = conn.recv()
        try:
            if command == "generate":
                prompts, params, kv = args
                reply: Any = [_summary(o) for o in llm.generate(prompts, params, kv)]
            elif command == "drain":
                idle = llm.drain(args[0])
                reply = {"idle": idle, **_state(llm)}
            elif command == "abort":
                llm.engine.abort_requests(args[0])
                reply = None
            elif command == "inject_failure":
                llm.engine.inject_kv_load_failure(args[0])
                reply = None
            elif command == "hold_reads":
                _hold_side_channel_reads(connector, gate, held)
                reply = None
            elif command == "held_reads":
                reply = len(held)
            elif command == "release_reads":
                gate.set()
                reply = None
            elif command == "corrupt_blocks":
                _corrupt_blocks(llm, *args)
                reply = None
            elif command == "reuse_after_next_renewal":
                _reuse_after_next_renewal(llm, *args)
                reply = None
            elif command == "abort_during_read":
                reply = _abort_during_read(llm, *args)
            elif command == "close":
                gate.set()  # no read stays held in a closing engine
                llm.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", reply))
        except Exception:  # report to the test, keep serving
            conn.send(("error", traceback.format_exc()))


def _hold_side_channel_reads(connector: Any, gate: threading.Event, held: list[int]) -> None:
    """This engine's ReadBlocks streams wait for `gate` ("release_reads") before each chunk
    (noted in `held` while they wait): an abort elsewhere lands while a read is in flight."""
    server = connector.worker.server
    original = server.block_chunks

    def holding(block_ids: list[int], shard: int = 0) -> Any:
        for chunk in original(block_ids, shard):
            held.append(chunk[0])
            gate.wait(_HOLD_TIMEOUT_S)
            held.remove(chunk[0])
            yield chunk

    server.block_chunks = holding


def _corrupt_blocks(llm: Any, block_ids: list[int], how: str) -> None:
    """Change KV blocks of this engine in place, as faulty memory or a reused block would:
    "flip" one bit in the middle of each; "stale" gives each the bytes of another block that
    differs from it (as if it had been freed and rewritten with other tokens' KV); "reused"
    moves each one's generation and leaves its bytes (as if it had been freed and taken by a
    request that has not written it yet: only the generation can tell)."""
    cache = llm.engine.runner.kv_cache
    flat = cache.view(cache.shape[0], -1).view(torch.uint8)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    for block_id in block_ids:
        if how == "reused":
            pool.blocks[block_id].generation += 1
        elif how == "flip":
            # The top exponent bit of a float32 in the middle of the block: one bit that
            # changes what the model computes from it (a low mantissa bit might not).
            flat[block_id, flat.shape[1] // 8 * 4 + 3] ^= 0x40
        elif how == "stale":
            other = next(
                b for b in range(flat.shape[0]) if not torch.equal(flat[b], flat[block_id])
            )
            flat[block_id] = flat[other]
        else:
            raise ValueError(f"unknown corruption {how!r}")


def _reuse_after_next_renewal(llm: Any, block_ids: list[int]) -> None:
    """Right after the next lease renewal this engine grants (a reader's check before it
    reads), `block_ids` are "reused" (see _corrupt_blocks): freed and taken while the reader
    reads them."""
    leases = llm.engine.connector.worker.server.leases
    renew = leases.renew

    def renew_then_reuse(lease_id: str) -> Any:
        lease = renew(lease_id)
        leases.renew = renew
        _corrupt_blocks(llm, block_ids, "reused")
        return lease

    leases.renew = renew_then_reuse


def _abort_during_read(llm: Any, prompts: Any, params: Any, kv: Any) -> dict[str, Any]:
    """Start decode requests, abort them once their reads are in flight."""
    import time

    from engine.output_processor import OutputProcessor

    processor = OutputProcessor(llm.tokenizer)
    ids = [llm._add(processor, p, sp, k) for p, sp, k in zip(prompts, params, kv, strict=True)]
    deadline = time.monotonic() + 30
    reading: set[str] = set()
    while time.monotonic() < deadline and len(reading) < len(ids):
        llm.engine.step()
        reading = llm.engine.connector.worker.reads.in_flight & set(ids)
    llm.engine.abort_requests(ids)
    held = len(llm.engine.scheduler.requests)  # blocks still written into: not yet freed
    return {"aborted_while_reading": len(reading), "held_after_abort": held}


class EngineProcess:
    def __init__(self, model: str = "tiny", **engine_kwargs: Any) -> None:
        ctx = peer_context()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, model, engine_kwargs), daemon=True)
        self.process.start()
        if not self._conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise TimeoutError("engine process did not start")
        _, self.port = self._conn.recv()

    def call(self, command: str, *args: Any, timeout: float = 120) -> Any:
        self._conn.send((command, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"engine process did not answer {command!r} in {timeout}s")
        status, reply = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"engine process failed on {command!r}:\n{reply}")
        return reply

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        kv_transfer_params: Any = None,
    ) -> list[dict[str, Any]]:
        return self.call("generate", prompts, params, kv_transfer_params)

    def drain(self, timeout_s: float = 20.0) -> dict[str, Any]:
        return self.call("drain", timeout_s, timeout=timeout_s + 30)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
                self.call("close", timeout=30)
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
