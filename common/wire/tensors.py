"""Tensors on the wire: little-endian buffers described by name, dtype, shape and encoding.

A message that carries tensors is a stream of chunks: the first chunk holds the header (with one
:class:`TensorSpec` per tensor), and every chunk holds :class:`TensorPiece` byte ranges, filled up
to ``chunk_bytes``, which the config keeps within gRPC's default 4 MiB limit. Encoding takes
byte views of the tensors (one copy per piece into the protobuf message); decoding copies each
piece once into a preallocated buffer per tensor. Where chunks arrive in bulk (the server's result
streams, the load generator's task streams), :func:`read_chunk` reads the serialized message
itself, so a piece is never copied into a protobuf message and out again. Nothing is pickled.

A spec with an ``encoding`` (:mod:`fedpart.common.wire.codecs`) carries a codec's payload instead of
the raw bytes: sizes, limits and byte counts are those of the payload, and the assembler decodes
it (through :func:`fedpart.common.wire.codecs.decode`, the one place that does) into a tensor of the
spec's dtype and shape.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from fedpart.common.wire.codecs import CodecError, Encoded, decode, payload_nbytes
from fedpart.common.wire.sizes import DEFAULT_CHUNK_BYTES
from fedpart.proto import fedpart_pb2 as pb

TensorSpec = pb.TensorSpec  # a tensor's name, dtype, shape, version and encoding on the wire

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_LITTLE_ENDIAN = sys.byteorder == "little"

# Chunk messages (TaskChunk and ResultChunk share the layout) hold pieces in field 2: one tag byte.
_PIECES_FIELD_TAG_BYTES = 1


class WireError(ValueError):
    """A message whose tensors do not match their declared names, dtypes or shapes."""


class IncompleteMessage(WireError):
    """A stream that ended before the last byte its header declared: what a connection cut
    off leaves (and all a hostile sender can claim to be), so the message is sent again."""


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError as error:
        raise WireError(f"dtype {dtype} cannot travel on the wire") from error


def decoded_nbytes(spec: pb.TensorSpec) -> int:
    """Number of bytes the (decoded) tensor described by ``spec`` occupies."""
    if spec.dtype not in DTYPES:
        raise WireError(f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}")
    count = 1
    for dim in spec.shape:
        if dim < 0:
            raise WireError(f"tensor {spec.name!r}: negative dimension in shape {list(spec.shape)}")
        count *= dim
    return count * DTYPES[spec.dtype].itemsize


def spec_nbytes(spec: pb.TensorSpec) -> int:
    """Number of bytes that follow ``spec`` on the wire: the raw tensor's, or its encoded payload's."""
    nbytes = decoded_nbytes(spec)
    if not spec.encoding:
        if spec.codec_args:
            raise WireError(f"tensor {spec.name!r}: codec_args {sorted(spec.codec_args)} given without an encoding")
        return nbytes
    dtype = DTYPES[spec.dtype]
    try:
        return payload_nbytes(spec.encoding, dtype, nbytes // dtype.itemsize, spec.codec_args)
    except CodecError as error:
        raise WireError(f"tensor {spec.name!r}: {error}") from error


def make_spec(name: str, tensor: torch.Tensor, version: int = 0) -> pb.TensorSpec:
    """The spec of ``tensor`` under ``name``."""
    return pb.TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), version=version)


def wire_form(name: str, tensor: torch.Tensor, encoded: Encoded | None,
              version: int = 0) -> tuple[pb.TensorSpec, torch.Tensor]:
    """The spec and the tensor to send for ``tensor``: itself when ``encoded`` is None, else its
    payload (the spec still describes ``tensor``)."""
    spec = make_spec(name, tensor, version)
    return (encoded.fill(spec), encoded.payload) if encoded is not None else (spec, tensor)


def encoding_bytes(specs: Iterable[pb.TensorSpec], wire_by_index: Mapping[int, int]) -> dict[str, dict[str, int]]:
    """``{encoding: {"wire": n, "raw": m}}``: serialized piece bytes of the tensors by encoding
    (``none`` for raw ones) next to the bytes of the decoded tensors, for the compression ratio."""
    counts: dict[str, dict[str, int]] = {}
    for index, spec in enumerate(specs):
        entry = counts.setdefault(spec.encoding or "none", {"wire": 0, "raw": 0})
        entry["wire"] += wire_by_index.get(index, 0)
        entry["raw"] += decoded_nbytes(spec)
    return counts


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in little-endian order, without copying on little-endian hosts."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if not _LITTLE_ENDIAN and flat.element_size() > 1:
        flat = _swap_bytes(flat)
    return memoryview(flat.view(torch.uint8).numpy())


def _swap_bytes(flat: torch.Tensor) -> torch.Tensor:
    """Reverse the byte order of each element (big-endian hosts only)."""
    size = flat.element_size()
    return flat.view(torch.uint8).view(-1, size).flip(1).reshape(-1).view(flat.dtype)


def varint_size(value: int) -> int:
    """Bytes a protobuf varint of ``value`` takes."""
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def _piece_bytes(index: int, length: int) -> int:
    """Bytes a piece of ``length`` data bytes for tensor ``index`` adds to its chunk message."""
    body = 1 + varint_size(length) + length
    if index:
        body += 1 + varint_size(index)
    return _PIECES_FIELD_TAG_BYTES + varint_size(body) + body


def chunk_pieces(chunk) -> list[tuple[int, bytes]]:
    """The ``(tensor index, bytes)`` of a chunk's pieces, each read once: reading a bytes field of
    a protobuf message copies it, so a receiver measures and assembles from this list."""
    return [(piece.index, piece.data) for piece in chunk.pieces]


def _fitting_length(index: int, room: int, wanted: int) -> int:
    """The most data bytes (up to ``wanted``) whose framed piece fits into ``room`` bytes."""
    length = min(wanted, room)
    while length > 0 and _piece_bytes(index, length) > room:
        length -= max(1, _piece_bytes(index, length) - room)
    return max(length, 0)


def iter_piece_groups(tensors: Iterable[torch.Tensor],
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[list[tuple[int, memoryview]]]:
    """Cut the tensors' bytes into ``(tensor index, byte view)`` pieces, grouped so that the
    pieces of one chunk take at most ``chunk_bytes`` serialized bytes (framing included)."""
    group: list[tuple[int, memoryview]] = []
    room = chunk_bytes
    for index, tensor in enumerate(tensors):
        view = _byte_view(tensor)
        offset = 0
        while offset < len(view):
            take = _fitting_length(index, room, len(view) - offset)
            if take == 0:
                if not group:
                    raise ValueError(f"chunk_bytes {chunk_bytes} cannot hold even one framed byte")
                yield group
                group, room = [], chunk_bytes
                continue
            group.append((index, view[offset:offset + take]))
            offset += take
            room -= _piece_bytes(index, take)
    if group:
        yield group


def encode_chunks(chunk_type: type, header, tensors: Iterable[torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator:
    """A chunk stream: the header in the first chunk, the tensors' pieces spread over all chunks.

    ``header`` must already list the specs of ``tensors`` in the same order; with ``header``
    None the chunks carry pieces only (to follow a header sent on its own). Each piece's bytes
    are copied once, straight into its chunk.
    """
    first = True
    for group in iter_piece_groups(tensors, chunk_bytes):
        chunk = chunk_type()
        if first and header is not None:
            chunk.header.CopyFrom(header)
        first = False
        for index, view in group:
            chunk.pieces.add(index=index, data=view.tobytes())
        yield chunk
    if first and header is not None:
        yield chunk_type(header=header)


def serialized_pieces(tensors: Iterable[torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized messages of :func:`encode_chunks` without a header, byte for byte what
    protobuf writes for them (TaskChunk and ResultChunk alike), with each piece's bytes copied once,
    from the tensor into the message: building the messages first copies them three times (the
    piece's bytes, the message's field, the serialization)."""
    for group in iter_piece_groups(tensors, chunk_bytes):
        parts: list[bytes | memoryview] = []
        for index, view in group:
            index_field = _INDEX_TAG + _varint(index) if index else b""
            data_field_head = _DATA_TAG + _varint(len(view))
            parts += [_PIECES_TAG + _varint(len(index_field) + len(data_field_head) + len(view)), index_field,
                      data_field_head, view]
        yield b"".join(parts)


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_then_pieces(chunk_type: type, header, tensors: Iterable[torch.Tensor],
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator:
    """A chunk stream whose first chunk is the header alone, then :func:`encode_chunks` of the
    tensors. Serialized, it is as long as the stream with the header in the first chunk of pieces.
    A receiver that checks the header and then waits before reading on (the server waits for an
    upload slot) holds only the small header meanwhile; flow control keeps the pieces at the sender
    (gRPC may take in about one message of them, so ``chunk_bytes`` bounds that).
    """
    yield chunk_type(header=header)
    yield from encode_chunks(chunk_type, None, tensors, chunk_bytes)


@dataclass
class ChunkBytes:
    """Serialized size of one chunk split into tensor bytes (per tensor index) and the rest."""

    total: int
    by_tensor: dict[int, int]

    @property
    def control(self) -> int:
        return self.total - sum(self.by_tensor.values())


@dataclass
class ReceivedChunk:
    """A chunk message read from its serialized bytes by :func:`read_chunk`: its pieces are views
    of those bytes (no copy), and ``size`` is measured from them, not re-encoded."""

    header: Message | None  # the parsed header message, when the chunk carries one
    pieces: list[tuple[int, memoryview]]
    size: ChunkBytes
    malformed: str = ""  # why the bytes are not a chunk message ("" when they are)


# Protobuf wire types (https://protobuf.dev/programming-guides/encoding/) and the two fields a
# chunk message holds: its header (1) and its pieces (2); a piece holds index (1) and data (2).
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_HEADER_FIELD, _PIECES_FIELD = 1, 2
_INDEX_FIELD, _DATA_FIELD = 1, 2
# the keys :func:`serialized_pieces` writes (field numbers below 16 take one byte)
_PIECES_TAG = bytes([_PIECES_FIELD << 3 | _LENGTH_DELIMITED])
_INDEX_TAG = bytes([_INDEX_FIELD << 3 | _VARINT])
_DATA_TAG = bytes([_DATA_FIELD << 3 | _LENGTH_DELIMITED])
_MAX_VARINT_BYTES = 10
_UINT32_MAX = (1 << 32) - 1


class _Malformed(Exception):
    pass


def _read_varint(data: memoryview, position: int, end: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it."""
    value = shift = 0
    for offset in range(_MAX_VARINT_BYTES):
        if position + offset >= end:
            raise _Malformed("a varint runs past the end of its message")
        byte = data[position + offset]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position + offset + 1
        shift += 7
    raise _Malformed(f"a varint longer than {_MAX_VARINT_BYTES} bytes")


def _read_field(data: memoryview, position: int, end: int) -> tuple[int, int, int, int]:
    """``(field number, wire type, start, next)`` of the field at ``position``: for a
    length-delimited field its value is ``data[start:next]``, for other wire types ``start`` is
    where the value begins (a varint's value is read by the caller)."""
    key, position = _read_varint(data, position, end)
    number, wire_type = key >> 3, key & 7
    if number == 0:
        raise _Malformed("field number 0")
    if wire_type == _VARINT:
        return number, wire_type, position, _read_varint(data, position, end)[1]
    if wire_type == _LENGTH_DELIMITED:
        length, start = _read_varint(data, position, end)
        if length > end - start:
            raise _Malformed("a field runs past the end of its message")
        return number, wire_type, start, start + length
    width = {_FIXED64: 8, _FIXED32: 4}.get(wire_type)
    if width is None:
        raise _Malformed(f"wire type {wire_type}")
    if position + width > end:
        raise _Malformed("a field runs past the end of its message")
    return number, wire_type, position, position + width


def _read_piece(data: memoryview, start: int, end: int) -> tuple[int, memoryview]:
    """The ``(index, data)`` of the TensorPiece message in ``data[start:end]`` (later
    occurrences of a field win, as protobuf parses them; other fields are skipped)."""
    index, piece = 0, data[start:start]
    position = start
    while position < end:
        number, wire_type, value, position = _read_field(data, position, end)
        if number == _INDEX_FIELD and wire_type == _VARINT:
            index = _read_varint(data, value, end)[0]
            if index > _UINT32_MAX:
                raise _Malformed(f"piece index {index} does not fit in 32 bits")
        elif number == _DATA_FIELD and wire_type == _LENGTH_DELIMITED:
            piece = data[value:position]
    return index, piece


def read_chunk(header_type: type, data: bytes) -> ReceivedChunk:
    """Read a serialized chunk message (TaskChunk or ResultChunk, whose header is a
    ``header_type``) without copying its pieces. Bytes that are no such message come back with
    ``malformed`` saying why, never as an exception: this runs as gRPC's deserializer of
    messages from the network. Fields the schema does not have count as control bytes in
    ``size`` (and ``size.control`` of a chunk with only pieces is 0), as they would in a parsed
    message's ``ByteSize()``."""
    view = memoryview(data)
    end = len(view)
    header_fields: list[memoryview] = []
    pieces: list[tuple[int, memoryview]] = []
    try:
        position = 0
        while position < end:
            number, wire_type, start, position = _read_field(view, position, end)
            if wire_type != _LENGTH_DELIMITED:
                continue
            if number == _HEADER_FIELD:
                header_fields.append(view[start:position])
            elif number == _PIECES_FIELD:
                pieces.append(_read_piece(view, start, position))
        header = None
        if header_fields:  # repeated occurrences merge, as protobuf parses them
            header = header_type.FromString(b"".join(header_fields) if len(header_fields) > 1 else header_fields[0])
    except (_Malformed, DecodeError) as error:
        return ReceivedChunk(None, [], ChunkBytes(end, {}), f"not a chunk message: {error}")
    by_tensor: dict[int, int] = {}
    for index, piece in pieces:
        by_tensor[index] = by_tensor.get(index, 0) + _piece_bytes(index, len(piece))
    return ReceivedChunk(header, pieces, ChunkBytes(end, by_tensor))


def measure_chunk(chunk, pieces: Sequence[tuple[int, bytes]] | None = None) -> ChunkBytes:
    """Exact serialized size of a chunk message, attributing each piece (field tag, length prefix
    and body) to its tensor; ``pieces`` are the chunk's :func:`chunk_pieces` when already read."""
    by_tensor: dict[int, int] = {}
    for index, data in chunk_pieces(chunk) if pieces is None else pieces:
        by_tensor[index] = by_tensor.get(index, 0) + _piece_bytes(index, len(data))
    return ChunkBytes(total=chunk.ByteSize(), by_tensor=by_tensor)


class TensorAssembler:
    """Rebuilds tensors from a header's specs and the pieces that follow, validating sizes.

    By default each tensor gets its own buffer at its first piece. With ``into``, a tensor whose
    name it holds is assembled into that caller's tensor instead (it must be a contiguous CPU
    tensor of the spec's dtype and shape, not shared with another name), so a server can reuse a
    bounded pool of staging buffers across results; the other tensors get their own buffers, and
    tensors of ``into`` that the specs do not name are left alone. Pieces fill each tensor from its
    start, so a complete tensor holds no byte of its previous contents. An encoded tensor's payload
    is assembled in a buffer of its own and decoded into the caller's tensor (or a new one).
    ``max_total_bytes`` bounds both the bytes that follow and the decoded tensors.
    """

    def __init__(self, specs: Iterable[pb.TensorSpec], max_total_bytes: int | None = None,
                 into: Mapping[str, torch.Tensor] | None = None) -> None:
        self.specs = list(specs)
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise WireError("duplicate tensor names in one message")
        self._expected = [spec_nbytes(spec) for spec in self.specs]
        if max_total_bytes is not None:
            for what, total in (("tensor", sum(self._expected)), ("decoded", sum(map(decoded_nbytes, self.specs)))):
                if total > max_total_bytes:
                    raise WireError(f"message declares {total} {what} bytes, more than the {max_total_bytes} allowed")
        into = into or {}
        self._targets = [_checked_target(spec, into[spec.name]) if spec.name in into else None for spec in self.specs]
        _check_disjoint([(spec.name, target) for spec, target in zip(self.specs, self._targets) if target is not None])
        self._buffers: list[memoryview | None] = [  # writable bytes; allocated by the first piece if not given
            _writable_bytes(target) if target is not None and not spec.encoding else None
            for spec, target in zip(self.specs, self._targets)]
        self._filled = [0] * len(self.specs)
        self._wire = [0] * len(self.specs)  # serialized piece bytes per tensor

    def add(self, pieces: Iterable[tuple[int, bytes]]) -> None:
        """Append the pieces' bytes (a chunk's :func:`chunk_pieces`) to their tensors."""
        for index, data in pieces:
            if index >= len(self.specs):
                raise WireError(f"piece for tensor index {index}, but only {len(self.specs)} tensors declared")
            start = self._filled[index]
            end = start + len(data)
            if end > self._expected[index]:
                spec = self.specs[index]
                raise WireError(f"tensor {spec.name!r}: more bytes than its dtype {spec.dtype} and shape {list(spec.shape)} hold")
            if self._buffers[index] is None:
                self._buffers[index] = empty_bytes(self._expected[index])
            self._buffers[index][start:end] = data
            self._filled[index] = end
            self._wire[index] += _piece_bytes(index, end - start)

    def encoding_bytes(self) -> dict[str, dict[str, int]]:
        """Serialized and decoded bytes by encoding of the pieces added so far."""
        return encoding_bytes(self.specs, dict(enumerate(self._wire)))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The complete tensors by name (the caller's own tensor for a name of ``into``); raises if
        any is short of bytes."""
        for spec, filled, expected in zip(self.specs, self._filled, self._expected):
            if filled != expected:
                raise IncompleteMessage(f"tensor {spec.name!r}: got {filled} of {expected} bytes")
        out: dict[str, torch.Tensor] = {}
        for spec, target, buffer, expected in zip(self.specs, self._targets, self._buffers, self._expected):
            dtype = DTYPES[spec.dtype]
            if spec.encoding:
                tensor = self._decoded(spec, target, buffer)
            elif target is not None:
                if not _LITTLE_ENDIAN and dtype.itemsize > 1:
                    target.view(-1).copy_(_swap_bytes(target.view(-1)))
                tensor = target
            elif expected == 0:
                tensor = torch.empty(tuple(spec.shape), dtype=dtype)
            else:
                tensor = torch.frombuffer(buffer, dtype=dtype)
                if not _LITTLE_ENDIAN and dtype.itemsize > 1:
                    tensor = _swap_bytes(tensor)
                tensor = tensor.reshape(tuple(spec.shape))
            out[spec.name] = tensor
        return out

    @staticmethod
    def _decoded(spec: pb.TensorSpec, target: torch.Tensor | None, buffer: memoryview | None) -> torch.Tensor:
        """The tensor an encoded payload describes, decoded into ``target`` or a new tensor."""
        payload = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
        out = target if target is not None else torch.empty(tuple(spec.shape), dtype=DTYPES[spec.dtype])
        try:
            return decode(Encoded(spec.encoding, payload, dict(spec.codec_args)), out)
        except CodecError as error:
            raise WireError(f"tensor {spec.name!r}: {error}") from error


def _checked_target(spec: pb.TensorSpec, target: torch.Tensor) -> torch.Tensor:
    """``target`` if it can receive the tensor ``spec`` describes; raises WireError otherwise."""
    dtype = DTYPES[spec.dtype]
    problems = []
    if target.dtype != dtype:
        problems.append(f"dtype {target.dtype}, the message declares {dtype}")
    if tuple(target.shape) != tuple(spec.shape):
        problems.append(f"shape {list(target.shape)}, the message declares {list(spec.shape)}")
    if target.device.type != "cpu":
        problems.append(f"device {target.device}, not the CPU")
    if not target.is_contiguous():
        problems.append("not contiguous")
    if target.requires_grad:
        problems.append("requires grad")
    if problems:
        raise WireError(f"tensor {spec.name!r}: the buffer to assemble it into has " + "; ".join(problems))
    return target


def _check_disjoint(targets: list[tuple[str, torch.Tensor]]) -> None:
    """Raise WireError if two of the named target tensors share bytes."""
    spans = sorted((target.data_ptr(), target.data_ptr() + target.nbytes, name)
                   for name, target in targets if target.nbytes)
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise WireError(f"tensors {name!r} and {other!r} would be assembled into overlapping buffers")


def empty_bytes(count: int) -> memoryview:
    """``count`` writable bytes left as the allocator gave them: a buffer that is filled whole
    before it is read need not be zeroed first (a zeroing pass costs as much as the fill's copy)."""
    return memoryview(np.empty(count, dtype=np.uint8))


def _writable_bytes(target: torch.Tensor) -> memoryview:
    """The target's bytes as a writable memoryview (no copy)."""
    return memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())


def decode_chunks(chunks: Iterable, max_total_bytes: int | None = None,
                  into: Callable[[Sequence[pb.TensorSpec]], Mapping[str, torch.Tensor]] | None = None):
    """Read a whole chunk stream: returns ``(header, tensors by name)``. ``into``, given the
    header's specs, names buffers to assemble tensors into (see :class:`TensorAssembler`)."""
    iterator = iter(chunks)
    try:
        first = next(iterator)
    except StopIteration as error:
        raise WireError("empty message stream") from error
    if not first.HasField("header"):
        raise WireError("the first chunk carries no header")
    header = first.header
    assembler = TensorAssembler(header.tensors, max_total_bytes, into(header.tensors) if into else None)
    assembler.add(chunk_pieces(first))
    for chunk in iterator:
        if chunk.HasField("header"):
            raise WireError("a second header inside one message stream")
        assembler.add(chunk_pieces(chunk))
    return header, assembler.tensors()


def named_specs(tensors: Mapping[str, torch.Tensor], versions: Mapping[str, int] | None = None) -> list[pb.TensorSpec]:
    """Specs for a name -> tensor mapping, in its order."""
    versions = versions or {}
    return [make_spec(name, tensor, versions.get(name, 0)) for name, tensor in tensors.items()]
