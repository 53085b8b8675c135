"""How the integration tests start peer processes (engines, side-channel servers): forked from
multiprocessing's forkserver once it has imported torch and the engine, not spawned afresh.

A spawned engine process spends about two of its three CPU-seconds of start-up importing them,
and the suite starts dozens: on 2 cores that is minutes. A forked child is still a process of
its own, with its own engine, NIXL agent and sockets; the forkserver only imports (no threads,
no engine, no UCX, and not gRPC, whose core keeps threads a fork would not copy), so forking
it is safe. Two things are the forkserver's, fixed when the session first starts a peer: the
environment (the session's variables are set before; no test sets any for a peer) and where
it imports the engine from (the checkout `make test` runs in: its working directory, and the
editable install of its own virtual environment).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext

# What every peer imports before it does anything: the heavy part of its start-up. Neither
# imports gRPC (an engine with a KV connector imports it when it builds one, in the child).
_PRELOAD = ["torch", "engine.llm"]


def peer_context() -> BaseContext:
    """The context to start peer processes in (its Process and Pipe)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context
