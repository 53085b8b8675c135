"""EngineArgs: the user-facing knobs (vLLM's names where one exists) -> EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_known_keys,
    check_load_format,
    config_from_dict,
)
from engine.models import ModelArchConfig
from engine.models.catalog import TINY_MODEL, is_gguf_path, resolve_model
from engine.parallel.layout import check_tensor_parallel, shares_kv_cache


@dataclass
class EngineArgs:
    """An engine's arguments, under vLLM's names (`LLM(model, **engine_args)`, a serve
    config's `engine_args`, `pdserve generate`'s flags)."""

    model: str = TINY_MODEL
    """a named model (smollm2, tiny), a model directory or a .gguf file"""
    tokenizer: str | None = None
    """a directory with tokenizer.json (none: the model's own)"""
    dtype: str = "auto"
    """weights and activations: float32, bfloat16, float16 (auto: float32 on CPUs)"""
    seed: int = 0
    """the engine's seed, for requests that sample without one"""
    device: str = "auto"
    """cpu or cuda (auto: cuda when there is one)"""
    block_size: int = 16
    """tokens per KV block"""
    max_model_len: int | None = None
    """the context length (none: the model's)"""
    max_num_seqs: int = 128
    """requests in one step at most"""
    max_num_batched_tokens: int | None = None
    """tokens in one step at most (the token budget; none: from the context length)"""
    enable_prefix_caching: bool = True
    """reuse the KV blocks of a prompt's cached prefix"""
    enable_chunked_prefill: bool = True
    """a long prompt may be computed over several steps, beside decodes"""
    long_prefill_token_threshold: int = 0
    """a prompt's chunk in one step at most (0: no limit beyond the budget)"""
    num_gpu_blocks_override: int | None = None
    """KV blocks to allocate, whatever the memory budget says"""
    kv_cache_memory_bytes: int | None = None
    """bytes for the KV cache (none: 1 GiB on CPUs, gpu_memory_utilization on GPUs)"""
    gpu_memory_utilization: float = 0.9
    """the fraction of GPU memory the engine may use, KV cache included"""
    scheduling_policy: str = "fcfs"
    """fcfs, priority (a smaller `priority` first), or continuum (fcfs, and an agent session's
    finished turn keeps its KV pinned for a TTL predicted from its tool calls' gaps; its next
    turn goes first while the pin holds)"""
    kv_pin_budget: float = 0.25
    """the share of the KV pool finished turns may keep pinned for their sessions' next turns
    (a pin over it is refused; the request is served)"""
    async_scheduling: bool = False
    """schedule step N+1 while step N computes. Off by default: on a CPU whose cores all run
    the forward pass it costs more than it hides (docs/ARCHITECTURE.md §12)"""
    max_queued_prompt_tokens: int = 0
    """prompt tokens waiting to be computed, beyond which new requests are refused
    (engine/core/admission.py); 0: no bound"""
    step_trace_size: int = 0
    """steps of the scheduler's decisions each engine keeps for `pdserve trace steps` (a ring
    buffer; 0: off)"""
    attention_backend: str = "auto"
    """torch, cpu (the C++ paged kernel), triton (Triton kernels; on a CPU only under
    TRITON_INTERPRET=1) or cuda (SDPA over gathered blocks) (auto: cpu on CPUs, triton on
    CUDA)"""
    linear_backend: str = "auto"
    """torch, blocked (the C++ kernel) or onednn (auto: the device's)"""
    enforce_eager: bool = False
    """on CUDA, run every step eagerly instead of replaying captured decode graphs"""
    batch_invariant: bool = False
    """every token attends as a decode does, prompts too, so that an answer does not depend on
    how its prompt was chunked, batched, cached, preempted or migrated, to the last bit (CPUs,
    the cpu attention backend)"""
    load_format: str = "auto"
    """auto (read the checkpoint's weights) or dummy (build the model from its directory's
    config.json alone, every weight random, no weight file read: benchmarks of a model's shape)"""
    logits_processors: tuple[str, ...] = ()
    """custom logits processors, as module:Class"""
    kv_transfer_config: dict[str, Any] | None = None
    """KV transfer between engines (JSON): {"connector": "nixl", ...}"""
    speculative_config: dict[str, Any] | None = None
    """speculative decoding (JSON): {"method": "ngram", "num_speculative_tokens": k, ...}"""
    tensor_parallel_size: int = 1
    """processes that split the model's heads and MLP between them, one per rank (each on its
    own cores, or its own GPU)"""
    tensor_parallel_collectives: str = "auto"
    """how the ranks exchange: shm (shared memory, float32 on CPUs), torch (torch.distributed:
    gloo on CPUs, NCCL on GPUs) or auto (shm where it applies)"""
    tensor_parallel_kv_cache: str = "auto"
    """where the ranks keep KV: shared (one cache of every head in /dev/shm, each rank
    attending over its own: CPUs), per_rank (a cache of its own heads each, rank 0 mapping
    them all for KV transfer: always on GPUs) or auto (shared where it applies)"""
    kv_offloading_size: float = 0.0
    """GiB of a KV tier below the primary pool: blocks leaving the pool are copied there, and a
    prompt whose prefix is found there loads it back instead of computing it (0: no tier)"""
    kv_offloading_backend: str = "cpu"
    """the tier's medium: cpu (host memory) or disk (a file under kv_offloading_path)"""
    kv_offloading_path: str | None = None
    """disk: the directory of the tier's file (none: the system's temporary directory)"""
    kv_offloading_disk_size: float = 0.0
    """GiB of a disk tier below the host-memory tier (a third tier, in a file under
    kv_offloading_path): what host memory evicts goes down to it (0: none)"""
    kv_events_config: dict[str, Any] | None = None
    """{"enable_kv_cache_events": true}: number the prefix cache's events for a cluster index
    (vLLM's name and key)"""

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        check_known_keys("engine argument(s)", kwargs, cls)
        return cls(model=model, **kwargs)

    def model_path(self) -> Path:
        return resolve_model(self.model)

    def tokenizer_path(self) -> str | None:
        if self.tokenizer is None:
            return None
        path = Path(self.tokenizer).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a directory with tokenizer.json")
        return str(path)

    def create_engine_config(self) -> tuple[EngineConfig, ModelArchConfig]:
        path = self.model_path()
        check_load_format(self.load_format, is_gguf_path(path))  # before the file is read
        arch = ModelArchConfig.from_pretrained(path)
        max_model_len = self._max_model_len(arch)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        kv_transfer = None
        if self.kv_transfer_config is not None:
            kv_transfer = config_from_dict(
                "kv_transfer_config", self.kv_transfer_config, KVTransferConfig
            )
        config = EngineConfig(
            self._model_config(str(path), arch),
            self._cache_config(arch),
            self._scheduler_config(max_model_len),
            self.kv_cache_memory_bytes,
            self.gpu_memory_utilization,
            kv_transfer,
            self._speculative_config(arch),
            self._parallel_config(arch),
        )
        _check_parallel_support(config, arch)
        return config, arch

    def _parallel_config(self, arch: ModelArchConfig) -> ParallelConfig:
        parallel = ParallelConfig(
            self.tensor_parallel_size,
            self.tensor_parallel_collectives,
            self.tensor_parallel_kv_cache,
        )
        check_tensor_parallel(arch, parallel.tensor_parallel_size)
        return parallel

    def _model_config(self, path: str, arch: ModelArchConfig) -> ModelConfig:
        for flag in ("enforce_eager", "batch_invariant"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        device = _resolve_device(self.device)
        if self.batch_invariant and (device != "cpu" or self.attention_backend not in _PAGED):
            raise ValueError("batch_invariant needs a CPU device and the cpu attention backend")
        return ModelConfig(
            model=path,
            dtype=_resolve_dtype(self.dtype, device, arch),
            device=device,
            seed=self.seed,
            attention_backend=self.attention_backend,
            linear_backend=self.linear_backend,
            logits_processors=tuple(self.logits_processors),
            enforce_eager=self.enforce_eager,
            batch_invariant=self.batch_invariant,
            tokenizer=self.tokenizer_path(),
            load_format=self.load_format,
        )

    def _cache_config(self, arch: ModelArchConfig) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            sliding_window=arch.sliding_window,
            enable_kv_cache_events=self._kv_events_enabled(),
            kv_offloading_size=self.kv_offloading_size,
            kv_offloading_backend=self.kv_offloading_backend,
            kv_offloading_path=self.kv_offloading_path,
            kv_offloading_disk_size=self.kv_offloading_disk_size,
        )

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        max_batched = self.max_num_batched_tokens or (
            8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        )
        return SchedulerConfig(
            max_num_batched_tokens=max_batched,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,  # type: ignore[arg-type]
            async_scheduling=self.async_scheduling,
            max_queued_prompt_tokens=self.max_queued_prompt_tokens,
            step_trace_size=self.step_trace_size,
            kv_pin_budget=self.kv_pin_budget,
        )

    def _speculative_config(self, arch: ModelArchConfig) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        speculative = config_from_dict(
            "speculative_config", self.speculative_config, SpeculativeConfig
        )
        if speculative.uses_draft_model:
            speculative = _resolve_draft_model(speculative, arch)
        return speculative

    def _kv_events_enabled(self) -> bool:
        events = config_from_dict("kv_events_config", self.kv_events_config or {}, KVEventsConfig)
        return events.enable_kv_cache_events

    def _max_model_len(self, arch: ModelArchConfig) -> int:
        if self.max_model_len is None:
            return arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={arch.max_position_embeddings}"
            )
        return self.max_model_len


def _check_parallel_support(config: EngineConfig, arch: ModelArchConfig) -> None:
    """A KV cache layout the ranks cannot have, refused by name."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return
    shared = shares_kv_cache(arch, size, config.model.device, config.parallel.kv_cache)
    if config.parallel.kv_cache == "shared" and not shared:
        raise ValueError(
            f"tensor_parallel_kv_cache='shared' needs device cpu and the model's "
            f"{arch.num_key_value_heads} KV heads split evenly between {size} ranks"
        )


# The attention backends whose decodes read the paged cache in place (batch_invariant's path).
_PAGED = ("auto", "cpu")


def _resolve_device(device: str) -> str:
    if device == "cpu":
        return device
    if device != "auto" and not device.startswith("cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    import torch  # only to look for a GPU: "cpu" (the router's) needs no torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return device


def _resolve_dtype(dtype: str, device: str, arch: ModelArchConfig) -> str:
    if dtype == "auto":
        if device == "cpu":
            return "float32"  # CPU half-precision matmuls are slow and not the parity oracle
        return arch.torch_dtype if arch.torch_dtype in ("bfloat16", "float16") else "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return dtype


def _resolve_draft_model(config: SpeculativeConfig, target: ModelArchConfig) -> SpeculativeConfig:
    """The draft model's path, once it is known to share the target's vocabulary (its drafts
    are token ids the target verifies)."""
    assert config.model is not None
    path = resolve_model(config.model)
    draft = ModelArchConfig.from_pretrained(path)
    if draft.sliding_window is not None or target.sliding_window is not None:
        # Blocks out of the target's window are freed and reused while the worker's table
        # still names them: a draft attending over them would read another request's K/V.
        raise ValueError("speculative method 'draft_model' does not support sliding-window models")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model {config.model!r} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target.vocab_size}: a draft model must share the target's tokenizer"
        )
    return replace(config, model=str(path))
