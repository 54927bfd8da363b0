from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProcessStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BootPhase(_message.Message):
    __slots__ = ("name", "start_s", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    start_s: float
    seconds: float
    def __init__(self, name: _Optional[str] = ..., start_s: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProcessStats(_message.Message):
    __slots__ = ("pid", "cpu_seconds", "uptime_s", "rss_bytes", "num_threads", "boot", "serving_after_s")
    PID_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    BOOT_FIELD_NUMBER: _ClassVar[int]
    SERVING_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    pid: int
    cpu_seconds: float
    uptime_s: float
    rss_bytes: int
    num_threads: int
    boot: _containers.RepeatedCompositeFieldContainer[BootPhase]
    serving_after_s: float
    def __init__(self, pid: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., uptime_s: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., num_threads: _Optional[int] = ..., boot: _Optional[_Iterable[_Union[BootPhase, _Mapping]]] = ..., serving_after_s: _Optional[float] = ...) -> None: ...
