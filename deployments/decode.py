"""DecodeServer: reads a prompt's KV from a prefill replica, then generates the rest.

ColocatedServer is the same engine doing both (the colocated mode, for comparison).
"""

from __future__ import annotations

from ray import serve

from deployments.engine_server import EngineServer


class DecodeServer(EngineServer):
    role = "decode"


class ColocatedServer(EngineServer):
    role = "colocated"


DecodeDeployment = serve.deployment(name="DecodeServer")(DecodeServer)
ColocatedDeployment = serve.deployment(name="EngineServer")(ColocatedServer)
