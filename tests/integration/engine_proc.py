"""An LLM engine in its own process, driven over a pipe (real processes for KV transfer)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from typing import Any

from engine.request import SamplingParams

_START_TIMEOUT_S = 120


def _summary(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "kv_transfer_params": output.kv_transfer_params,
        "error": output.error,
        "num_cached_tokens": output.num_cached_tokens,
    }


def _state(llm: Any) -> dict[str, Any]:
    engine = llm.engine
    manager = engine.scheduler.kv_cache_manager
    try:
        manager.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = f"broken: {exc}"
    connector = engine.connector
    return {
        "integrity": integrity,
        "free_blocks": manager.block_pool.get_num_free_blocks(),
        "usable_blocks": engine.num_blocks - 1,
        "unfinished": engine.scheduler.get_num_unfinished_requests(),
        "held_requests": len(engine.scheduler.requests),
        "stats": dict(connector.stats) if connector is not None else {},
    }


def _serve(conn: Any, model: str, engine_kwargs: dict[str, Any]) -> None:
    from engine.llm import LLM

    llm = LLM(model, **engine_kwargs)
    connector = llm.engine.connector
    conn.send(("ready", connector.side_channel_port if connector is not None else None))
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
                transport = connector.worker.transport
                if hasattr(transport, "inject_failure_after_blocks"):
                    transport.inject_failure_after_blocks(args[0])
                else:
                    transport.inject_failure()
                reply = None
            elif command == "close":
                llm.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", reply))
        except Exception:  # report to the test, keep serving
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    def __init__(self, model: str = "default", **engine_kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
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
