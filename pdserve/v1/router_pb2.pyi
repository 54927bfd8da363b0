from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "max_tokens", "session_id", "reusable_prefix_len", "skip_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    SKIP_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    session_id: str
    reusable_prefix_len: int
    skip_text: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., session_id: _Optional[str] = ..., reusable_prefix_len: _Optional[int] = ..., skip_text: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    final: FinalInfo
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., final: _Optional[_Union[FinalInfo, _Mapping]] = ...) -> None: ...

class FinalInfo(_message.Message):
    __slots__ = ("finish_reason", "usage", "prefill_worker", "decode_worker", "transport", "kv_blocks_sent", "kv_bytes_sent", "kv_blocks_reused", "session_moved", "fallback", "fallback_reason", "placement_policy", "moved_from", "move_reason", "prefill_cached_tokens", "session_hit", "prefill_mode", "prefill_mode_reason", "allocate_ms", "prefill_rpc_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_wait_ms")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    SESSION_MOVED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    MOVE_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_HIT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RPC_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: _common_pb2.Usage
    prefill_worker: str
    decode_worker: str
    transport: str
    kv_blocks_sent: int
    kv_bytes_sent: int
    kv_blocks_reused: int
    session_moved: bool
    fallback: bool
    fallback_reason: str
    placement_policy: str
    moved_from: str
    move_reason: str
    prefill_cached_tokens: int
    session_hit: bool
    prefill_mode: str
    prefill_mode_reason: str
    allocate_ms: float
    prefill_rpc_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_wait_ms: float
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., transport: _Optional[str] = ..., kv_blocks_sent: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_blocks_reused: _Optional[int] = ..., session_moved: _Optional[bool] = ..., fallback: _Optional[bool] = ..., fallback_reason: _Optional[str] = ..., placement_policy: _Optional[str] = ..., moved_from: _Optional[str] = ..., move_reason: _Optional[str] = ..., prefill_cached_tokens: _Optional[int] = ..., session_hit: _Optional[bool] = ..., prefill_mode: _Optional[str] = ..., prefill_mode_reason: _Optional[str] = ..., allocate_ms: _Optional[float] = ..., prefill_rpc_ms: _Optional[float] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., kv_wait_ms: _Optional[float] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerEntry(_message.Message):
    __slots__ = ("worker_id", "role", "address", "healthy", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    healthy: bool
    stats: _common_pb2.WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., stats: _Optional[_Union[_common_pb2.WorkerStats, _Mapping]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEntry]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerEntry, _Mapping]]] = ...) -> None: ...
