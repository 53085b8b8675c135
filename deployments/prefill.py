"""PrefillServer: runs prompts (max_tokens=1) and holds their KV blocks for a decode replica."""

from __future__ import annotations

from ray import serve

from deployments.engine_server import EngineServer


class PrefillServer(EngineServer):
    role = "prefill"


PrefillDeployment = serve.deployment(name="PrefillServer")(PrefillServer)
