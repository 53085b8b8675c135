"""Engine configuration: small validated dataclasses, one per concern."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

SchedulingPolicy = Literal["fcfs", "priority", "continuum"]
_POLICIES = ("fcfs", "priority", "continuum")
_HASH_ALGOS = ("sha256",)
# The KV transports (connector/): the one list every edge (CLI, app, bench) checks against.
TransportName = Literal["nixl", "grpc"]
KV_TRANSPORTS: tuple[TransportName, ...] = ("nixl", "grpc")
KVLoadFailurePolicy = Literal["recompute", "fail"]
KV_LOAD_FAILURE_POLICIES: tuple[KVLoadFailurePolicy, ...] = ("recompute", "fail")
# vLLM's names: "auto" reads the checkpoint; "dummy" builds the model from config.json alone,
# random weights, no weight file read (benchmarks of a model's shape, not its answers).
LOAD_FORMATS = ("auto", "dummy")

_Config = TypeVar("_Config")


def check_known_keys(what: str, given: Any, config_class: type) -> None:
    """ValueError naming the keys of `given` that are not fields of the dataclass."""
    known = {f.name for f in fields(config_class)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {sorted(known)}")


def config_from_dict(what: str, value: Any, config_class: type[_Config]) -> _Config:
    """A config dataclass from a dict of its fields (or the dataclass itself), ValueError
    for anything else or for unknown keys."""
    if isinstance(value, config_class):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict, got {type(value).__name__}")
    check_known_keys(f"{what} keys", value, config_class)
    return config_class(**value)


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
    # Schedule step N+1 while step N computes (engine_core.AsyncRunner).
    async_scheduling: bool = False
    # Refuse a new prompt (QueueFull) past this many prompt tokens still to be computed;
    # 0: no bound (offline batches queue everything at once). engine/core/admission.py.
    max_queued_prompt_tokens: int = 0
    # Steps the per-step scheduler trace keeps (engine/core/step_trace.py); 0: off.
    step_trace_size: int = 0
    # The share of the KV pool finished turns may keep pinned (engine/core/pins.py).
    kv_pin_budget: float = 0.25
    # Known output tokens (preemption, migration) recomputed one per step, as decoding first
    # computed them: set by the engine where its linears quantize activations
    # (engine/core/recompute.py).
    stepwise_recompute: bool = False

    def __post_init__(self) -> None:
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_model_len", self.max_model_len, 1)
        _require_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _require_int("max_queued_prompt_tokens", self.max_queued_prompt_tokens, 0)
        _require_int("step_trace_size", self.step_trace_size, 0)
        budget = self.kv_pin_budget
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 <= budget <= 1:
            raise ValueError(f"kv_pin_budget must be a fraction in [0, 1], got {budget!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
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
    # A tier below the primary pool (engine/offload/): GiB of it, 0 for none (vLLM's names).
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "cpu"  # cpu (host memory) or disk (a file)
    kv_offloading_path: str | None = None  # disk: the directory of its file (default: /tmp)
    # GiB of a disk tier below the host-memory one (a third tier): blocks the host tier
    # evicts go down to it instead of being dropped.
    kv_offloading_disk_size: float = 0.0
    # The tiers' blocks: filled in by the engine from the sizes above and a block's bytes.
    num_tier_blocks: int | None = None
    num_disk_tier_blocks: int | None = None  # the third tier's (kv_offloading_disk_size)

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1)
        _check_offloading(self)
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


_OFFLOADING_BACKENDS = ("cpu", "disk")


def _check_offloading(config: CacheConfig) -> None:
    size = config.kv_offloading_size
    for name in ("kv_offloading_size", "kv_offloading_disk_size"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r}")
    if config.kv_offloading_disk_size and not (size and config.kv_offloading_backend == "cpu"):
        raise ValueError(
            "kv_offloading_disk_size is a disk tier below the host-memory one: it needs "
            "kv_offloading_size > 0 with kv_offloading_backend 'cpu'"
        )
    if config.kv_offloading_backend not in _OFFLOADING_BACKENDS:
        raise ValueError(
            f"kv_offloading_backend must be one of {_OFFLOADING_BACKENDS}, "
            f"got {config.kv_offloading_backend!r}"
        )
    on_disk = config.kv_offloading_backend == "disk" or config.kv_offloading_disk_size
    if config.kv_offloading_path is not None and not on_disk:
        raise ValueError(
            "kv_offloading_path is for kv_offloading_backend 'disk' or kv_offloading_disk_size"
        )
    if size and not config.enable_prefix_caching:
        raise ValueError(
            "kv_offloading_size needs enable_prefix_caching (tiers keep cached blocks)"
        )
    if size and config.sliding_window is not None:
        raise ValueError("kv_offloading_size is not supported for sliding-window models yet")


@dataclass(frozen=True)
class KVEventsConfig:
    """The `kv_events_config` engine argument (vLLM's name): publish the prefix cache's events."""

    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"enable_kv_cache_events must be a bool, got {self.enable_kv_cache_events!r}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in what precision, on which device."""

    model: str  # resolved: a model directory or a .gguf file
    dtype: str = "float32"  # resolved: float32 | bfloat16 | float16
    device: str = "cpu"  # resolved: cpu | cuda | cuda:N
    seed: int = 0
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    logits_processors: tuple[str, ...] = ()
    # A directory with tokenizer.json to use instead of the model's own tokenizer (vLLM's
    # --tokenizer); None: the model directory's, or the one in the GGUF file's metadata.
    tokenizer: str | None = None
    # vLLM's name: no CUDA graphs (every decode step launches its kernels one by one).
    enforce_eager: bool = False
    load_format: str = "auto"  # one of LOAD_FORMATS
    # Every token attends as a decode does (engine/worker/step_inputs.py: plan_step).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        check_load_format(self.load_format)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model


@dataclass(frozen=True)
class SideChannelTLS:
    """Mutual TLS on the engines' side channel (`kv_transfer_config.tls`): every engine serves
    and calls with one certificate (PEM files) that the shared CA signed, and refuses peers
    without one. `server_name` is the name in that certificate the callers check: engines are
    reached by pod IP, so one shared name (a DNS SAN) stands in for the address."""

    certfile: str
    keyfile: str
    ca_certs: str
    server_name: str = "pdserve-engine"

    def __post_init__(self) -> None:
        for name in ("certfile", "keyfile", "ca_certs", "server_name"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"kv_transfer_config.tls.{name} must be a non-empty string")

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA certificates), read now (a rotated Secret is
        picked up by the next channel or server)."""
        pems = []
        for name in ("certfile", "keyfile", "ca_certs"):
            try:
                with open(getattr(self, name), "rb") as file:
                    pems.append(file.read())
            except OSError as exc:
                raise ValueError(f"kv_transfer_config.tls.{name}: {exc.strerror}") from None
        return pems[0], pems[1], pems[2]


KV_DATA_FAULTS = ("flip", "truncate", "stale")
KV_FAULTS = (*KV_DATA_FAULTS, "delay", "lose", "die")


@dataclass(frozen=True)
class KVFaultInjection:
    """Faults injected into this engine's KV reads, to prove they are caught (tests, `pdserve
    bench chaos`; off by default): with probability `rate` per read, as it completes, one of
    `faults` is done to it (connector/faults.py) — to one of its blocks, "flip": a bit
    flipped; "truncate": the block's second half lost (zeroed); "stale": another block's bytes
    in its place (a reused block); to the read, "delay": its completion reported `delay_s`
    late; "lose": never reported; "die": the remote dies mid-read. Only block changes that
    alter the bytes are made and counted (`faults_injected`), so every one must show up as a
    checksum failure."""

    rate: float = 0.0
    faults: tuple[str, ...] = KV_FAULTS
    seed: int = 0
    delay_s: float = 0.3

    def __post_init__(self) -> None:
        rate = self.rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"fault_injection.rate must be in [0, 1], got {self.rate!r}")
        faults = self.faults
        if not isinstance(faults, (list, tuple)) or not faults or set(faults) - set(KV_FAULTS):
            raise ValueError(f"fault_injection.faults must be some of {KV_FAULTS}")
        object.__setattr__(self, "faults", tuple(faults))
        delay = self.delay_s
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ValueError(f"fault_injection.delay_s must be >= 0, got {delay!r}")


_KV_DEADLINES = ("heartbeat_timeout_s", "handshake_timeout_s", "read_timeout_base_s")


@dataclass(frozen=True)
class KVTransferConfig:
    """How an engine takes part in KV transfer (the `kv_transfer_config` engine argument).

    `connector` names the transport, as vLLM's `kv_connector` names a connector: every engine
    runs the same PDConnector (connector/) and can both produce and consume KV.
    """

    connector: TransportName = "nixl"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: pick a free port
    secret: str = ""
    lease_seconds: float = 30.0
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    # A stable name for this engine in handshakes and kv_transfer_params ("" = random).
    engine_id: str = ""
    # Mutual TLS on the side channel (a SideChannelTLS or its dict); None: plain text, the
    # shared secret alone.
    tls: SideChannelTLS | None = None
    # Faults injected into this engine's reads (a KVFaultInjection or its dict); None: none.
    fault_injection: KVFaultInjection | None = None
    # How long a remote engine may leave a lease renewal or release unanswered before it is
    # taken for gone (its reads fail to the policy within this and a 0.25 s heartbeat).
    heartbeat_timeout_s: float = 0.75
    # The first call to a remote engine (compatibility handshake) waits at most this long.
    handshake_timeout_s: float = 2.0
    # A read not reported done by this, plus its bytes and those of the reads in flight
    # before it at 100 MB/s, is cancelled and fails (a lost completion, a stuck transfer).
    read_timeout_base_s: float = 1.0

    def __post_init__(self) -> None:
        if self.tls is not None:
            tls = config_from_dict("kv_transfer_config.tls", self.tls, SideChannelTLS)
            object.__setattr__(self, "tls", tls)
        if self.fault_injection is not None:
            faults = config_from_dict(
                "kv_transfer_config.fault_injection", self.fault_injection, KVFaultInjection
            )
            object.__setattr__(self, "fault_injection", faults)
        check_transport(self.connector, "connector")
        port = self.side_channel_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"side_channel_port must be in [0, 65535], got {port!r}")
        for name in ("lease_seconds", *_KV_DEADLINES):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not 0 < value < math.inf:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        check_load_failure_policy(self.kv_load_failure_policy, "kv_load_failure_policy")
        if not isinstance(self.secret, str):
            raise ValueError("secret must be a string")


def check_transport(name: object, what: str = "transport") -> None:
    if name not in KV_TRANSPORTS:
        raise ValueError(f"{what} must be one of {KV_TRANSPORTS}, got {name!r}")


def check_load_failure_policy(policy: object, what: str = "load_failure_policy") -> None:
    if policy not in KV_LOAD_FAILURE_POLICIES:
        raise ValueError(f"{what} must be one of {KV_LOAD_FAILURE_POLICIES}, got {policy!r}")


def check_load_format(load_format: object, gguf: bool = False) -> None:
    """ValueError unless `load_format` is one of LOAD_FORMATS and fits the checkpoint (`gguf`:
    a .gguf file, which has no config.json for "dummy" to build from)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "dummy" and gguf:
        raise ValueError(
            "load_format 'dummy' builds the model from a directory's config.json; "
            "a .gguf file has none (give a model directory, or load_format 'auto')"
        )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (the `speculative_config` engine argument, vLLM's names).

    `ngram`: prompt lookup — drafts copied from where the sequence's last n tokens occurred
    before (engine/spec_decode/ngram.py). `draft_model`: a smaller model sharing the target's
    vocabulary drafts greedily (`model`; engine/worker/draft_model.py).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model of method "draft_model" (a name or a path)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative method 'draft_model' needs a draft 'model'")
        elif self.model is not None:
            raise ValueError(f"'model' is for method 'draft_model', not {self.method!r}")
        _require_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _require_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _require_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"


TP_COLLECTIVES = ("auto", "shm", "torch")
TP_KV_CACHES = ("auto", "shared", "per_rank")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism inside one engine (engine/parallel/): `tensor_parallel_size`
    processes, one per rank, each holding its share of every layer's heads and MLP width.
    `collectives`: shm (shared memory between ranks on one host, float32 on CPUs), torch
    (torch.distributed: gloo on CPUs, NCCL on GPUs), auto (shm where it applies).
    `kv_cache`: shared (one cache of every head on a CPU host), per_rank (each rank its own
    heads' cache, every one mapped by rank 0), auto (shared where it applies)."""

    tensor_parallel_size: int = 1
    collectives: str = "auto"
    kv_cache: str = "auto"

    def __post_init__(self) -> None:
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.collectives not in TP_COLLECTIVES:
            raise ValueError(
                f"tensor-parallel collectives must be one of {TP_COLLECTIVES}, "
                f"got {self.collectives!r}"
            )
        if self.kv_cache not in TP_KV_CACHES:
            raise ValueError(
                f"tensor_parallel_kv_cache must be one of {TP_KV_CACHES}, got {self.kv_cache!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an EngineCore is built from. `cache.num_blocks` may stay None: the worker
    then sizes the KV cache from `kv_cache_memory_bytes` (CPU) or `gpu_memory_utilization`."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_transfer: KVTransferConfig | None = None
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = ParallelConfig()
