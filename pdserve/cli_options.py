"""The options of `pdserve generate`, `client`, `trace-sink` and `make-model`: each field is a
flag (pdserve/flags.py), its docstring the flag's help. `serve` takes its flags from the app's
own configuration (pdserve/serve_command.py), the benchmarks from theirs (pdserve/bench/)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.flags import Flag


def token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids takes comma-separated integers, got {text!r}"
        ) from None


@dataclass
class PromptOptions:
    """What `generate` and `client` send, and how they print what comes back."""

    prompt: list[str] = field(default_factory=list)
    """a user message, rendered with the model's chat template"""
    raw: bool = False
    """send --prompt as plain text (a completion prompt), without the chat template"""
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    """a prompt as comma-separated token ids"""
    json: bool = False
    """print one JSON object per prompt: its token ids, the output's ids, text, finish reason"""


PROMPT_FLAGS = {
    "prompt": Flag(repeat=True),
    "prompt_token_ids": Flag(repeat=True, parse=token_ids, metavar="IDS"),
}


# engine.arg_utils.EngineArgs, as `generate` spells it.
ENGINE_FLAGS = {"logits_processors": Flag(repeat=True, metavar="MODULE:CLASS")}


@dataclass
class SamplingOptions:
    """How `generate` and `client` sample (the request's SamplingParams)."""

    max_tokens: int | None = None
    """output tokens at most (none: a chat answer may use what the context leaves after the
    prompt, as OpenAI's chat completions; a --raw prompt gets 16, as its completions)"""
    temperature: float = 0.0
    """0: greedy"""
    top_p: float = 1.0
    """sample from the smallest set of tokens whose probabilities add up to this"""
    top_k: int = -1
    """sample from this many most likely tokens (-1: all)"""
    sampling_seed: int | None = None
    """the request's seed: the same seed draws the same tokens (none: the engine's draws)"""
    ignore_eos: bool = False
    """go on past the end-of-sequence token, up to max_tokens"""


@dataclass
class EndpointOptions:
    """Where a command calls the gRPC API (GenerationClient.connect takes these)."""

    target: str = "127.0.0.1:9000"
    """the gRPC proxy, HOST:PORT"""
    application: str = "pdserve"
    """the Serve app to call (Serve's gRPC proxy routes on it)"""
    api_key: str | None = None
    """sent as 'authorization: Bearer KEY' (none: $PDSERVE_API_KEY's first key)"""
    tls_ca: str | None = None
    """call the proxy's TLS port, trusting this CA certificate (PEM; 'system': the system's
    roots)"""


@dataclass
class ClientOptions(EndpointOptions):
    """Where `client` calls the gRPC API, and how."""

    stream: bool = False
    """print the text as it arrives"""
    timeout: float = 300.0
    """seconds a request may take"""


@dataclass
class TraceSinkOptions:
    """Where `trace-sink` listens for OTLP/gRPC spans."""

    host: str = "127.0.0.1"
    """the address to listen on"""
    port: int = 4317
    """the port to listen on (OTLP/gRPC's own)"""
    quiet: bool = False
    """receive and drop the spans (benchmarks)"""


@dataclass
class MakeModelOptions:
    """Where `make-model` writes the generated tiny test model."""

    path: str | None = None
    """the directory (none: the cache directory)"""
    seed: int | None = None
    """the weights' seed (none: the default model's)"""
