from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("compatibility_hash", "engine_id", "expected_engine_id", "transport")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    compatibility_hash: str
    transport: str
    expected_engine_id: str
    def __init__(
        self,
        engine_id: str | None = ...,
        compatibility_hash: str | None = ...,
        transport: str | None = ...,
        expected_engine_id: str | None = ...,
    ) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = (
        "block_bytes",
        "compatibility_hash",
        "engine_id",
        "num_blocks",
        "transport",
        "transport_metadata",
    )
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    compatibility_hash: str
    transport_metadata: bytes
    num_blocks: int
    block_bytes: int
    transport: str
    def __init__(
        self,
        engine_id: str | None = ...,
        compatibility_hash: str | None = ...,
        transport_metadata: bytes | None = ...,
        num_blocks: int | None = ...,
        block_bytes: int | None = ...,
        transport: str | None = ...,
    ) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: str | None = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("expires_in_seconds", "lease_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    expires_in_seconds: float
    def __init__(
        self, lease_id: str | None = ..., expires_in_seconds: float | None = ...
    ) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool | None = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("block_ids", "lease_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(
        self, lease_id: str | None = ..., block_ids: _Iterable[int] | None = ...
    ) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("block_bytes", "block_id", "data", "offset")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    offset: int
    data: bytes
    block_bytes: int
    def __init__(
        self,
        block_id: int | None = ...,
        offset: int | None = ...,
        data: bytes | None = ...,
        block_bytes: int | None = ...,
    ) -> None: ...
