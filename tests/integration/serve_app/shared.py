"""What the modules of this package share: the app they all serve, its prompts and limits, and
the offline engine's greedy answers (the oracle)."""

from __future__ import annotations

from typing import Any

from deployments.launch import COLOCATED_APP_NAME
from engine.llm import LLM
from engine.request import SamplingParams
from tests.integration.serving import AppSettings

MAX_MODEL_LEN = 256
ENGINE_ARGS = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 16 << 20}
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
]
COLOCATED = COLOCATED_APP_NAME

LIMITS = {"max_body_bytes": 1 << 20, "max_prompt_chars": 20_000, "max_stop_strings": 8}
HEAVY_LIMITS = {
    "max_body_bytes": 64 << 20,
    "max_prompt_chars": 20_000_000,
    "max_stop_strings": 200_000,
}
SETTINGS = AppSettings(
    app={
        "model": "tiny",
        "engine_args": ENGINE_ARGS,
        # Small limits, so the tests can cross them with small requests.
        **LIMITS,
        "num_cpus_per_engine": 0.5,
        "transport": "nixl",
        "lease_seconds": 20,
    },
    # The colocated app takes heavy requests (test_load.py: test_heavy_requests_...).
    extra_apps={COLOCATED: {"colocated": True, **HEAVY_LIMITS}},
)


def greedy(llm: LLM, prompt: str | list[int], max_tokens: int, **kw: Any) -> Any:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return llm.generate([prompt], params)[0]
