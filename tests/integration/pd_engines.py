"""P/D engines in processes of their own for the KV-transfer tests: their settings, how a
prompt goes through a prefill engine and a decode engine, and what must hold afterwards."""

from __future__ import annotations

from dataclasses import replace

from engine.config import KVTransferConfig
from engine.llm import LLM
from tests.integration.engine_proc import EngineProcess

BLOCK = 8
ENGINE = dict(max_model_len=128, block_size=BLOCK, num_gpu_blocks_override=96)
SECRET = "s3cret"


# A healthy engine on a loaded CI machine can miss the shipped deadlines (0.75 s a renewal):
# tests give them room, but those of the deadlines (a silent remote, lost completions).
PATIENT = {"heartbeat_timeout_s": 5.0, "handshake_timeout_s": 10.0, "read_timeout_base_s": 10.0}
SHIPPED = {name: getattr(KVTransferConfig(), name) for name in PATIENT}


def kv_config(transport: str, **overrides) -> dict:
    base = {"connector": transport, "secret": SECRET, "lease_seconds": 10.0}
    return {**base, **PATIENT, **overrides}


def engine(transport: str, **overrides) -> EngineProcess:
    """A P/D engine; it schedules asynchronously (the colocated oracle does not)."""
    kv = kv_config(transport, **overrides.pop("kv", {}))
    args = {**ENGINE, "async_scheduling": True, **overrides}
    return EngineProcess("tiny", **args, kv_transfer_config=kv)


def reference(colocated: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in colocated.generate(prompts, params)]


def prefill_then_decode(prefill, decode, prompts, params, tamper=None):
    one = [replace(p, max_tokens=1) for p in params]
    firsts = prefill.generate(prompts, one, {"do_remote_decode": True})
    kv = [f["kv_transfer_params"] for f in firsts]
    if tamper is not None:
        kv = [tamper(dict(k)) for k in kv]
    return firsts, decode.generate(prompts, params, kv)


def assert_idle_and_clean(*engines: EngineProcess) -> None:
    for proc in engines:
        state = proc.drain()
        assert state["idle"], state
        assert state["integrity"] == "ok", state
        assert state["free_blocks"] == state["usable_blocks"], state
        assert state["held_requests"] == 0, state
