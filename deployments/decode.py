"""DecodeServer: reads a prompt's KV from a prefill replica, then generates the rest."""

from __future__ import annotations

from ray import serve

from deployments.engine_server import EngineServer


@serve.deployment(name="DecodeServer")
class DecodeServer(EngineServer):
    role = "decode"


@serve.deployment(name="EngineServer")
class ColocatedServer(EngineServer):
    """Colocated mode, for comparison: one deployment does prefill and decode."""

    role = "colocated"
