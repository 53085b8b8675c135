"""BlockData of ReadBlocks, encoded and decoded by hand on the hot path.

The bytes are exactly protobuf's (kv_transfer.proto, message BlockData), so any protobuf peer
reads them; doing it by hand saves the copies protobuf makes of a multi-MiB `data` field. A
field added to BlockData in the .proto must be added here too.
"""

from __future__ import annotations

from typing import NamedTuple


class BlockChunk(NamedTuple):
    block_id: int
    offset: int
    data: memoryview
    block_bytes: int

    @property
    def last(self) -> bool:
        return self.offset + len(self.data) == self.block_bytes


def encode_block_data(block_id: int, offset: int, data: memoryview, block_bytes: int) -> bytes:
    """Serialized BlockData(block_id, offset, data, block_bytes); copies `data` once."""
    fields = (1, block_id), (2, offset), (4, block_bytes), (3, len(data))
    header = b"".join(
        _varint(field << 3 | (2 if field == 3 else 0)) + _varint(value) for field, value in fields
    )
    return b"".join((header, data))


def decode_block_data(message: bytes) -> BlockChunk:
    """Parse serialized BlockData, `data` a view of `message`. ValueError when malformed."""
    view, pos = memoryview(message), 0
    ints, data = {1: 0, 2: 0, 4: 0}, view[0:0]
    while pos < len(view):
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(view, pos)
            ints[field] = value
        elif wire_type == 2:
            size, pos = _read_varint(view, pos)
            data = view[pos : pos + size] if field == 3 else data
            pos += size
        elif wire_type in (1, 5):  # fixed64, fixed32: fields this reader does not know
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"BlockData: unsupported wire type {wire_type}")
    if pos != len(view):
        raise ValueError("BlockData: truncated")
    return BlockChunk(ints[1], ints[2], data, ints[4])


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(view):
            raise ValueError("BlockData: truncated")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise ValueError("BlockData: varint too long")


# ---------------------------------------------------------------------------------- leases
