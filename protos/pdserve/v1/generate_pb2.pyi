from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "logit_bias", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logit_bias: _containers.ScalarMap[int, float]
    structured_outputs: StructuredOutputs
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling_params", "priority", "cache_salt", "timeout_s", "pin")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling_params: SamplingParams
    priority: int
    cache_salt: str
    timeout_s: float
    pin: KVPin
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., timeout_s: _Optional[float] = ..., pin: _Optional[_Union[KVPin, _Mapping]] = ...) -> None: ...

class KVPin(_message.Message):
    __slots__ = ("session", "ttl_s", "after_tool")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOOL_FIELD_NUMBER: _ClassVar[int]
    session: str
    ttl_s: float
    after_tool: str
    def __init__(self, session: _Optional[str] = ..., ttl_s: _Optional[float] = ..., after_tool: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "pinned_ttl_s", "pin_refused")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PINNED_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PIN_REFUSED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    pinned_ttl_s: float
    pin_refused: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., pinned_ttl_s: _Optional[float] = ..., pin_refused: _Optional[bool] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("ttft_s", "e2e_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    e2e_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "sampled_rank")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_RANK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled_rank: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., sampled_rank: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timing", "logprobs", "prompt_token_ids", "route", "migrations")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    timing: Timing
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    route: str
    migrations: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., route: _Optional[str] = ..., migrations: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("role", "replica_id", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "num_held_requests", "kv_cache_usage", "state", "kv_checksum_failures", "kv_faults_injected", "kv_reads_failed", "kv_fenced_reads", "kv_unanswered_reads", "kv_faults_lost", "kv_faults_died", "kv_timed_out_reads", "tensor_parallel_size", "tp_collective_seconds", "role_epoch", "moved_requests", "kv_pieces_direct", "kv_pieces_staged")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_FAULTS_INJECTED_FIELD_NUMBER: _ClassVar[int]
    KV_READS_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_FENCED_READS_FIELD_NUMBER: _ClassVar[int]
    KV_UNANSWERED_READS_FIELD_NUMBER: _ClassVar[int]
    KV_FAULTS_LOST_FIELD_NUMBER: _ClassVar[int]
    KV_FAULTS_DIED_FIELD_NUMBER: _ClassVar[int]
    KV_TIMED_OUT_READS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_COLLECTIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MOVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_PIECES_DIRECT_FIELD_NUMBER: _ClassVar[int]
    KV_PIECES_STAGED_FIELD_NUMBER: _ClassVar[int]
    role: str
    replica_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_held_requests: int
    kv_cache_usage: float
    state: str
    kv_checksum_failures: int
    kv_faults_injected: int
    kv_reads_failed: int
    kv_fenced_reads: int
    kv_unanswered_reads: int
    kv_faults_lost: int
    kv_faults_died: int
    kv_timed_out_reads: int
    tensor_parallel_size: int
    tp_collective_seconds: float
    role_epoch: int
    moved_requests: int
    kv_pieces_direct: int
    kv_pieces_staged: int
    def __init__(self, role: _Optional[str] = ..., replica_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_held_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., state: _Optional[str] = ..., kv_checksum_failures: _Optional[int] = ..., kv_faults_injected: _Optional[int] = ..., kv_reads_failed: _Optional[int] = ..., kv_fenced_reads: _Optional[int] = ..., kv_unanswered_reads: _Optional[int] = ..., kv_faults_lost: _Optional[int] = ..., kv_faults_died: _Optional[int] = ..., kv_timed_out_reads: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., tp_collective_seconds: _Optional[float] = ..., role_epoch: _Optional[int] = ..., moved_requests: _Optional[int] = ..., kv_pieces_direct: _Optional[int] = ..., kv_pieces_staged: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "engines")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    status: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    def __init__(self, status: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "block_size", "mode", "transport")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    mode: str
    transport: str
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., mode: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class StepTraceRequest(_message.Message):
    __slots__ = ("max_steps", "keep_steps")
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEP_STEPS_FIELD_NUMBER: _ClassVar[int]
    max_steps: int
    keep_steps: int
    def __init__(self, max_steps: _Optional[int] = ..., keep_steps: _Optional[int] = ...) -> None: ...

class EngineStepTrace(_message.Message):
    __slots__ = ("role", "replica_id", "records", "error", "left_out")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    role: str
    replica_id: str
    records: _containers.RepeatedScalarFieldContainer[str]
    error: str
    left_out: int
    def __init__(self, role: _Optional[str] = ..., replica_id: _Optional[str] = ..., records: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., left_out: _Optional[int] = ...) -> None: ...

class StepTraceResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStepTrace]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStepTrace, _Mapping]]] = ...) -> None: ...
