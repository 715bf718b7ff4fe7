from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Storage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DURABLE: _ClassVar[Storage]
    CACHE: _ClassVar[Storage]

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[AckStatus]
    RESTART: _ClassVar[AckStatus]
    POISONED: _ClassVar[AckStatus]
    FAILED: _ClassVar[AckStatus]
DURABLE: Storage
CACHE: Storage
OK: AckStatus
RESTART: AckStatus
POISONED: AckStatus
FAILED: AckStatus

class CopyRequest(_message.Message):
    __slots__ = ("stream", "shard", "file", "storage", "start", "data", "hello", "shards", "operation", "source_cluster", "jump", "last_timestamp_us", "sealed", "epoch", "promotions_json")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    JUMP_FIELD_NUMBER: _ClassVar[int]
    LAST_TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    file: str
    storage: Storage
    start: int
    data: bytes
    hello: bool
    shards: int
    operation: str
    source_cluster: str
    jump: bool
    last_timestamp_us: int
    sealed: bool
    epoch: int
    promotions_json: str
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., file: _Optional[str] = ..., storage: _Optional[_Union[Storage, str]] = ..., start: _Optional[int] = ..., data: _Optional[bytes] = ..., hello: _Optional[bool] = ..., shards: _Optional[int] = ..., operation: _Optional[str] = ..., source_cluster: _Optional[str] = ..., jump: _Optional[bool] = ..., last_timestamp_us: _Optional[int] = ..., sealed: _Optional[bool] = ..., epoch: _Optional[int] = ..., promotions_json: _Optional[str] = ...) -> None: ...

class CopyAck(_message.Message):
    __slots__ = ("status", "length", "message", "durable_length")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    status: AckStatus
    length: int
    message: str
    durable_length: int
    def __init__(self, status: _Optional[_Union[AckStatus, str]] = ..., length: _Optional[int] = ..., message: _Optional[str] = ..., durable_length: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "cluster", "reading", "writing", "topology_sha256")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    READING_FIELD_NUMBER: _ClassVar[int]
    WRITING_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_SHA256_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    cluster: str
    reading: int
    writing: int
    topology_sha256: str
    def __init__(self, serving: _Optional[bool] = ..., cluster: _Optional[str] = ..., reading: _Optional[int] = ..., writing: _Optional[int] = ..., topology_sha256: _Optional[str] = ...) -> None: ...

class FilesRequest(_message.Message):
    __slots__ = ("stream", "shard", "source_cluster", "shards", "epoch", "promotions_json")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SOURCE_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    source_cluster: str
    shards: int
    epoch: int
    promotions_json: str
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., source_cluster: _Optional[str] = ..., shards: _Optional[int] = ..., epoch: _Optional[int] = ..., promotions_json: _Optional[str] = ...) -> None: ...

class FileState(_message.Message):
    __slots__ = ("name", "durable_length", "sealed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DURABLE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    name: str
    durable_length: int
    sealed: bool
    def __init__(self, name: _Optional[str] = ..., durable_length: _Optional[int] = ..., sealed: _Optional[bool] = ...) -> None: ...

class FilesResponse(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[FileState]
    def __init__(self, files: _Optional[_Iterable[_Union[FileState, _Mapping]]] = ...) -> None: ...
