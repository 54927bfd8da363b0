from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "max_tokens", "seed_draws", "stop_context", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_DRAWS_FIELD_NUMBER: _ClassVar[int]
    STOP_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    max_tokens: int
    seed_draws: int
    stop_context: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    constraint: Constraint
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed_draws: _Optional[int] = ..., stop_context: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
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

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("cache_events", "cache_events_after")
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    cache_events: bool
    cache_events_after: int
    def __init__(self, cache_events: _Optional[bool] = ..., cache_events_after: _Optional[int] = ...) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("tier", "stored", "hashes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    stored: bool
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tier: _Optional[str] = ..., stored: _Optional[bool] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheEvents(_message.Message):
    __slots__ = ("last", "snapshot", "batches", "more")
    LAST_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    last: int
    snapshot: bool
    batches: _containers.RepeatedCompositeFieldContainer[CacheEventBatch]
    more: bool
    def __init__(self, last: _Optional[int] = ..., snapshot: _Optional[bool] = ..., batches: _Optional[_Iterable[_Union[CacheEventBatch, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "incarnation", "layout_hash", "model_fingerprint", "queue_depth", "num_running", "free_blocks", "total_blocks", "block_size", "transports", "kv_endpoint", "address", "num_leased", "max_model_len", "kv_bytes_per_block", "max_num_seqs", "cache")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    incarnation: str
    layout_hash: str
    model_fingerprint: str
    queue_depth: int
    num_running: int
    free_blocks: int
    total_blocks: int
    block_size: int
    transports: _containers.RepeatedScalarFieldContainer[str]
    kv_endpoint: bytes
    address: str
    num_leased: int
    max_model_len: int
    kv_bytes_per_block: int
    max_num_seqs: int
    cache: CacheEvents
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., incarnation: _Optional[str] = ..., layout_hash: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., queue_depth: _Optional[int] = ..., num_running: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., transports: _Optional[_Iterable[str]] = ..., kv_endpoint: _Optional[bytes] = ..., address: _Optional[str] = ..., num_leased: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., cache: _Optional[_Union[CacheEvents, _Mapping]] = ...) -> None: ...

class RequestFacts(_message.Message):
    __slots__ = ("prefill_worker", "decode_worker", "transport", "fallback", "fallback_reason", "placement_policy", "session_hit", "session_moved", "moved_from", "move_reason", "decode_load", "decode_load_cap", "prefill_mode", "prefill_mode_reason", "kv_blocks_sent", "kv_bytes_sent", "kv_blocks_reused", "prefill_cached_tokens", "allocate_ms", "prefill_rpc_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_transfer_ms", "kv_wait_ms", "decode_ms", "admission_wait_est_ms", "decode_tier_tokens", "predicted_decode_blocks", "prefill_tier_tokens")
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    SESSION_HIT_FIELD_NUMBER: _ClassVar[int]
    SESSION_MOVED_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    MOVE_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOAD_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOAD_CAP_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RPC_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_WAIT_EST_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker: str
    decode_worker: str
    transport: str
    fallback: bool
    fallback_reason: str
    placement_policy: str
    session_hit: bool
    session_moved: bool
    moved_from: str
    move_reason: str
    decode_load: int
    decode_load_cap: int
    prefill_mode: str
    prefill_mode_reason: str
    kv_blocks_sent: int
    kv_bytes_sent: int
    kv_blocks_reused: int
    prefill_cached_tokens: int
    allocate_ms: float
    prefill_rpc_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_transfer_ms: float
    kv_wait_ms: float
    decode_ms: float
    admission_wait_est_ms: float
    decode_tier_tokens: int
    predicted_decode_blocks: int
    prefill_tier_tokens: int
    def __init__(self, prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., transport: _Optional[str] = ..., fallback: _Optional[bool] = ..., fallback_reason: _Optional[str] = ..., placement_policy: _Optional[str] = ..., session_hit: _Optional[bool] = ..., session_moved: _Optional[bool] = ..., moved_from: _Optional[str] = ..., move_reason: _Optional[str] = ..., decode_load: _Optional[int] = ..., decode_load_cap: _Optional[int] = ..., prefill_mode: _Optional[str] = ..., prefill_mode_reason: _Optional[str] = ..., kv_blocks_sent: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_blocks_reused: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., allocate_ms: _Optional[float] = ..., prefill_rpc_ms: _Optional[float] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., kv_wait_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., admission_wait_est_ms: _Optional[float] = ..., decode_tier_tokens: _Optional[int] = ..., predicted_decode_blocks: _Optional[int] = ..., prefill_tier_tokens: _Optional[int] = ...) -> None: ...
