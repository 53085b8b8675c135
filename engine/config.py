"""Engine configuration: small validated dataclasses, one per concern."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SchedulingPolicy = Literal["fcfs", "priority"]
_POLICIES = ("fcfs", "priority")
_HASH_ALGOS = ("sha256",)


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; `max_num_seqs=True` is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step and of one sequence."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_model_len", self.max_model_len, 1)
        _require_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {self.policy!r}")
        if not self.enable_chunked_prefill:
            # Without chunking a prompt is scheduled whole: a budget smaller than the longest
            # admissible prompt would leave that prompt waiting forever.
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "with enable_chunked_prefill=False, max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}) must be >= max_model_len "
                    f"({self.max_model_len})"
                )
            if self.long_prefill_token_threshold:
                raise ValueError(
                    "long_prefill_token_threshold chunks prompts; it needs "
                    "enable_chunked_prefill=True"
                )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry and prefix caching.

    `num_blocks` counts the null block (block 0), so `num_blocks - 1` blocks hold KV.
    It may be left `None` here and filled in by the worker from a memory budget.
    """

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    enable_kv_cache_events: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1)
        if self.num_blocks is not None:
            # One null block plus at least one usable block.
            _require_int("num_blocks", self.num_blocks, 2)
        if self.prefix_caching_hash_algo not in _HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {_HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.sliding_window is not None:
            _require_int("sliding_window", self.sliding_window, 1)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in what precision, on which device."""

    model: str
    dtype: str = "float32"  # resolved: float32 | bfloat16 | float16
    device: str = "cpu"  # resolved: cpu | cuda | cuda:N
    seed: int = 0
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    logits_processors: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    """Everything an EngineCore is built from. `cache.num_blocks` may stay None: the worker
    then sizes the KV cache from `kv_cache_memory_bytes` (CPU) or `gpu_memory_utilization`."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_transfer: Any = None  # connector.config.KVTransferConfig (engine/ does not import it)
