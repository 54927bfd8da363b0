from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankRequestId(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RankAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankDone(_message.Message):
    __slots__ = ("bytes", "backend")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    backend: str
    def __init__(self, bytes: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class RankExpectRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RankAbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RankAbortResponse(_message.Message):
    __slots__ = ("safe",)
    SAFE_FIELD_NUMBER: _ClassVar[int]
    safe: bool
    def __init__(self, safe: _Optional[bool] = ...) -> None: ...

class RankPiece(_message.Message):
    __slots__ = ("endpoint", "key", "dst", "head_start", "head_end")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    endpoint: bytes
    key: str
    dst: _containers.RepeatedScalarFieldContainer[int]
    head_start: int
    head_end: int
    def __init__(self, endpoint: _Optional[bytes] = ..., key: _Optional[str] = ..., dst: _Optional[_Iterable[int]] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ...) -> None: ...

class RankSendRequest(_message.Message):
    __slots__ = ("request_id", "src", "pieces", "streamed", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    src: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedCompositeFieldContainer[RankPiece]
    streamed: bool
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., src: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[_Union[RankPiece, _Mapping]]] = ..., streamed: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RankPushRequest(_message.Message):
    __slots__ = ("request_id", "layers", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    final: bool
    def __init__(self, request_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., final: _Optional[bool] = ...) -> None: ...

class RankStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStats(_message.Message):
    __slots__ = ("counts",)
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.ScalarMap[str, int]
    def __init__(self, counts: _Optional[_Mapping[str, int]] = ...) -> None: ...
