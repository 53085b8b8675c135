"""What the modules of this package share: the engines' settings, and the router's flow
(Orchestrator) over two in-process EngineServers, or over stand-ins for either leg."""

from __future__ import annotations

from typing import Any

from deployments.replica.engine_server import EngineServer
from deployments.router.kv_leases import LeaseReleaser
from deployments.router.orchestrator import FlowConfig, ModelFacts, Orchestrator

ENGINE_ARGS = {"max_model_len": 128, "kv_cache_memory_bytes": 8 << 20}
SECRET = "orchestrator-test"
PROMPT = "The quick brown fox jumps over the lazy dog"
KV = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}


def make_flow(
    servers: tuple[EngineServer, EngineServer],
    prefill: Any = "engine",
    decode: Any = None,
    **flow: Any,
) -> Orchestrator:
    prefill_server, decode_server = servers
    tokenizer = decode_server.engine.tokenizer
    arch = decode_server.engine.core.arch
    facts = ModelFacts("tiny", 128, arch.vocab_size)
    return Orchestrator(
        tokenizer,
        facts,
        FlowConfig(**flow),
        decode=decode or decode_server.generate,
        prefill=prefill_server.generate if prefill == "engine" else prefill,
        release=LeaseReleaser(SECRET),
    )
