from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LendPrefixRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LendPrefixResponse(_message.Message):
    __slots__ = ("engine_id", "request_id", "block_ids", "lease_id", "expires_in_seconds", "block_checksums")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    expires_in_seconds: float
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., expires_in_seconds: _Optional[float] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "compatibility_hash", "transport", "expected_engine_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    compatibility_hash: str
    transport: str
    expected_engine_id: str
    def __init__(self, engine_id: _Optional[str] = ..., compatibility_hash: _Optional[str] = ..., transport: _Optional[str] = ..., expected_engine_id: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "compatibility_hash", "transport_metadata", "num_blocks", "block_bytes", "transport", "shard_heads")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHARD_HEADS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    compatibility_hash: str
    transport_metadata: bytes
    num_blocks: int
    block_bytes: int
    transport: str
    shard_heads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., compatibility_hash: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., shard_heads: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    expires_in_seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., expires_in_seconds: _Optional[float] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("lease_id", "block_ids", "shard")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    shard: int
    def __init__(self, lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., shard: _Optional[int] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("block_id", "offset", "data", "block_bytes")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    offset: int
    data: bytes
    block_bytes: int
    def __init__(self, block_id: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...
