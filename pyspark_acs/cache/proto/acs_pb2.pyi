from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORED: _ClassVar[PutStatus]
    STALE: _ClassVar[PutStatus]
    TOO_LARGE: _ClassVar[PutStatus]
STORED: PutStatus
STALE: PutStatus
TOO_LARGE: PutStatus

class GetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "data", "sizes", "versions")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    data: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, found: _Optional[_Iterable[bool]] = ..., data: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("keys", "data", "sizes", "versions", "ttl_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    data: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., data: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[PutStatus]
    def __init__(self, status: _Optional[_Iterable[_Union[PutStatus, str]]] = ...) -> None: ...

class CompareAndSetRequest(_message.Message):
    __slots__ = ("key", "expect_absent", "expected", "value", "version", "ttl_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECT_ABSENT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    expect_absent: bool
    expected: bytes
    value: bytes
    version: int
    ttl_ms: int
    def __init__(self, key: _Optional[bytes] = ..., expect_absent: _Optional[bool] = ..., expected: _Optional[bytes] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class CompareAndSetResponse(_message.Message):
    __slots__ = ("swapped", "found", "value", "version")
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    swapped: bool
    found: bool
    value: bytes
    version: int
    def __init__(self, swapped: _Optional[bool] = ..., found: _Optional[bool] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("role", "values", "uptime_s")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    values: _containers.ScalarMap[str, int]
    uptime_s: float
    def __init__(self, role: _Optional[str] = ..., values: _Optional[_Mapping[str, int]] = ..., uptime_s: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "role", "uptime_s")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    role: str
    uptime_s: float
    def __init__(self, serving: _Optional[bool] = ..., role: _Optional[str] = ..., uptime_s: _Optional[float] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("add", "remove")
    ADD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    add: _containers.RepeatedScalarFieldContainer[bytes]
    remove: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, add: _Optional[_Iterable[bytes]] = ..., remove: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("keys", "found", "data", "sizes", "versions")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    found: _containers.RepeatedScalarFieldContainer[bool]
    data: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., found: _Optional[_Iterable[bool]] = ..., data: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("follow", "offsets", "latest", "latest_back")
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    LATEST_BACK_FIELD_NUMBER: _ClassVar[int]
    follow: _containers.RepeatedScalarFieldContainer[bytes]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    latest: _containers.RepeatedScalarFieldContainer[bytes]
    latest_back: int
    def __init__(self, follow: _Optional[_Iterable[bytes]] = ..., offsets: _Optional[_Iterable[int]] = ..., latest: _Optional[_Iterable[bytes]] = ..., latest_back: _Optional[int] = ...) -> None: ...

class FileBytes(_message.Message):
    __slots__ = ("files", "starts", "data", "sizes", "latest_files", "latest_ends")
    FILES_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    LATEST_FILES_FIELD_NUMBER: _ClassVar[int]
    LATEST_ENDS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedScalarFieldContainer[bytes]
    starts: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    latest_files: _containers.RepeatedScalarFieldContainer[bytes]
    latest_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, files: _Optional[_Iterable[bytes]] = ..., starts: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., latest_files: _Optional[_Iterable[bytes]] = ..., latest_ends: _Optional[_Iterable[int]] = ...) -> None: ...
