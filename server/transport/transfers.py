"""Bounds on the bytes in flight between the server and its client processes.

Uploads: a result is read only while it holds one of a fixed number of *upload slots*, each with
staging tensors that are reused from result to result (allocating and clearing fresh pages for
every result cost the server more than copying into them). A result stream that finds every slot
taken is simply not read: gRPC's flow control then stops its sender, so server memory is
O(slots x model), whatever the number of uploads in flight.

While a result stream waits for a slot, gRPC still takes in about one message of it (it lets a
message it has begun complete), so the waiting streams together hold up to processes x message
size, which at thousands of processes outweighs the upload slots themselves. Each training task
therefore names the largest message its result may come in (:func:`result_chunk_bytes`):
``server.waiting_upload_bytes`` shared among the connected processes, so a few processes send
large messages (fewer of them cost the server less CPU) and many send small ones.

Each connection's HTTP/2 window, the bytes it may send before the server reads them, is bounded
too (:func:`receive_window`): by default the windows of all the run's clients together hold 32
MiB (the run's clients bound its processes), each within [256 KiB, 4 MiB]. A small run gets
windows that hold a whole cnn2 result, so a sender is not woken for a window update every 128
KiB, which costs the client processes' gRPC threads CPU on every upload. Larger totals did not
pay in large runs, where they cost the server CPU (``benchmarks/server_scale.py --set
server.receive_window=...`` measures a window against the default), so runs from 128 clients up
keep 256 KiB.

Downloads: a task is sent only while it holds one of a fixed number of *download slots*; every
sent chunk is awaited until the transport took it, so at most one chunk per slot is buffered.
The tensor chunks themselves are encoded and serialized once per set of tensors and versions
(:class:`TaskPayloads`) and shared by every task that sends the same tensors, as a round sends
the same global model to every sampled client. With a download codec (``compression.down``) each
version of a global tensor is encoded once, and the chunks carry the encoded payloads.

Logical bytes (:mod:`fedpart.server.output.accounting`): what a task and its result would cost a client
that is its own device and holds nothing. They are computed from sizes the server knows, without
serializing anything more: :func:`stream_tensor_bytes` lays the tensors' payload lengths out into
chunks exactly as :func:`~fedpart.common.wire.tensors.encode_chunks` cuts the tensors themselves, and
:meth:`TaskPayloads.logical` keeps the result, with the bytes each spec adds to a header, for each
set of tensors and versions a task names.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch

from fedpart.common.wire.codecs import Codec, encode, seeded_generator
from fedpart.common.ml.split_model import tensor_part, tensor_unit
from fedpart.common.wire.tensors import (DTYPES, ChunkBytes, _fitting_length, _piece_bytes, encode_chunks,
                                         encoding_bytes, measure_chunk, spec_nbytes, varint_size, wire_form)
from fedpart.proto import fedpart_pb2 as pb

Layout = tuple[tuple[str, str, tuple[int, ...]], ...]


MIN_RESULT_CHUNK_BYTES = 64 << 10
MIN_RECEIVE_WINDOW = 256 << 10
MAX_RECEIVE_WINDOW = 4 << 20
RECEIVE_WINDOWS_BYTES = 32 << 20  # the default windows of all of a run's clients together
_HEADER_FIELD_TAG_BYTES = 1  # TaskChunk.header is field 1: one tag byte


def result_chunk_bytes(largest: int, waiting_upload_bytes: int, processes: int) -> int:
    """The largest message a training result may come in when ``processes`` are connected: their
    share of ``waiting_upload_bytes`` (0: no bound), at most ``largest``, and at least
    :data:`MIN_RESULT_CHUNK_BYTES`: beyond ``waiting_upload_bytes / 64 KiB`` processes the bound
    gives way rather than cut messages further, as every message costs the server CPU of its own."""
    if not waiting_upload_bytes:
        return largest
    share = waiting_upload_bytes // max(processes, 1)
    return min(largest, max(MIN_RESULT_CHUNK_BYTES, share))


def receive_window(configured: int | None, clients: int) -> int:
    """The HTTP/2 window of each connection to the server (0: gRPC's adaptive window): as
    configured, or else one client's share of :data:`RECEIVE_WINDOWS_BYTES`, within
    [:data:`MIN_RECEIVE_WINDOW`, :data:`MAX_RECEIVE_WINDOW`] (every process hosts at least one
    client, so the shares of its processes are within the total)."""
    if configured is not None:
        return configured
    return min(MAX_RECEIVE_WINDOW, max(MIN_RECEIVE_WINDOW, RECEIVE_WINDOWS_BYTES // max(clients, 1)))


def layout_of(specs: Iterable[pb.TensorSpec]) -> Layout:
    """Names, dtypes and shapes of a result's tensors: results with equal layouts share buffers."""
    return tuple((spec.name, spec.dtype, tuple(spec.shape)) for spec in specs)


class UploadSlots:
    """A bounded set of upload slots with reusable staging tensors (created in the event loop)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free = asyncio.Semaphore(slots)
        self._idle: list[tuple[Layout, dict[str, torch.Tensor]]] = []  # oldest first

    @asynccontextmanager
    async def staging(self, specs: Iterable[pb.TensorSpec]) -> AsyncIterator[dict[str, torch.Tensor]]:
        """Wait for a free slot; yields staging tensors for ``specs`` (checked by the caller
        against the task beforehand), which return to the pool on exit."""
        layout = layout_of(specs)
        async with self._free:
            buffers = self._take(layout)
            try:
                yield buffers
            finally:
                self._give_back(layout, buffers)

    def _take(self, layout: Layout) -> dict[str, torch.Tensor]:
        for index, (idle_layout, buffers) in enumerate(self._idle):
            if idle_layout == layout:
                del self._idle[index]
                return buffers
        return {name: torch.empty(shape, dtype=DTYPES[dtype]) for name, dtype, shape in layout}

    def _give_back(self, layout: Layout, buffers: dict[str, torch.Tensor]) -> None:
        self._idle.append((layout, buffers))
        if len(self._idle) > self.slots:  # a layout no longer used makes room, oldest first
            del self._idle[0]


class TaskPayloads:
    """Serialized tensor chunks of task streams with their bytes by part, for the last few sets of
    (tensor name, version) sent, and the wire form of each global tensor's latest version under
    the download ``codec`` (stochastic rounding seeded by ``seed``, the name and the version, so
    it is the same after a restart). Used from the event loop only."""

    def __init__(self, chunk_bytes: int, keep: int = 8, codec: Codec | None = None, seed: int = 0) -> None:
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self.codec = codec
        self.seed = seed
        self._encoded: OrderedDict[tuple, list[tuple[bytes, dict[str, int]]]] = OrderedDict()
        self._encoding_bytes: dict[tuple, dict[str, dict[str, int]]] = {}
        self._wire_forms: dict[str, tuple[int, pb.TensorSpec, torch.Tensor]] = {}  # name -> (version, spec, payload)
        self._logical: OrderedDict[tuple, LogicalTensors] = OrderedDict()

    def wire_forms(self, specs: list[pb.TensorSpec],
                   tensors: list[torch.Tensor]) -> tuple[list[pb.TensorSpec], list[torch.Tensor]]:
        """The specs and tensors to send for the global ``tensors``: themselves without a codec,
        else each version's encoded form, encoded at its first request."""
        if self.codec is None:
            return specs, tensors
        forms = []
        for spec, tensor in zip(specs, tensors):
            form = self._wire_forms.get(spec.name)
            if form is None or form[0] != spec.version:
                generator = seeded_generator(self.seed, zlib.crc32(spec.name.encode()), spec.version)
                encoded = encode(self.codec, tensor, generator)
                form = (spec.version, *wire_form(spec.name, tensor, encoded, spec.version))
                self._wire_forms[spec.name] = form
            forms.append(form[1:])
        return [spec for spec, _ in forms], [payload for _, payload in forms]

    def encoding_bytes(self, specs: list[pb.TensorSpec]) -> dict[str, dict[str, int]]:
        """Serialized and decoded bytes by encoding of the chunks :meth:`chunks` made for ``specs``."""
        return self._encoding_bytes[_key(specs)]

    def chunks(self, specs: list[pb.TensorSpec], tensors: list[torch.Tensor],
               parts: list[str]) -> list[tuple[bytes, dict[str, int]]]:
        """The serialized TaskChunk messages carrying ``tensors`` (described by ``specs``, in
        order), each with its bytes by part (a piece's bytes count for its tensor's part, the rest
        as control). Serialized once, they go out as they are to every task that sends them."""
        key = _key(specs)
        encoded = self._encoded.get(key)
        if encoded is None:
            encoded, wire_by_index = [], {}
            for chunk in encode_chunks(pb.TaskChunk, None, tensors, self.chunk_bytes):
                size = measure_chunk(chunk)
                encoded.append((chunk.SerializeToString(), bytes_by_part(size, parts)))
                for index, count in size.by_tensor.items():
                    wire_by_index[index] = wire_by_index.get(index, 0) + count
            self._encoded[key] = encoded
            self._encoding_bytes[key] = encoding_bytes(specs, wire_by_index)
            while len(self._encoded) > self.keep:
                del self._encoding_bytes[self._encoded.popitem(last=False)[0]]
        else:
            self._encoded.move_to_end(key)
        return encoded

    def logical(self, named: tuple[tuple[str, int], ...],
                wire_specs: Callable[[], list[pb.TensorSpec]]) -> LogicalTensors:
        """Logical sizes of the tensors ``named`` (names and versions) sent in a stream of their
        own, computed once per set of names and versions from ``wire_specs()``, their specs in
        wire form in the same order."""
        key = named
        sizes = self._logical.get(key)
        if sizes is None:
            sizes = LogicalTensors.of(wire_specs(), self.chunk_bytes, header_specs=True)
            self._logical[key] = sizes
            while len(self._logical) > self.keep:
                self._logical.popitem(last=False)
        else:
            self._logical.move_to_end(key)
        return sizes


@dataclass(frozen=True)
class LogicalTensors:
    """Tensors sent in a stream of their own: their serialized bytes by part and by schedule unit
    (which sum to the same total), and, for a task header, the bytes each tensor's spec adds."""

    by_part: dict[str, int]
    by_unit: dict[str, int]
    spec_bytes: dict[str, int]  # tensor name -> bytes of its spec in a TaskHeader (empty unless asked)

    @property
    def header_spec_bytes(self) -> int:
        """Bytes the specs of all these tensors add to a task header."""
        return sum(self.spec_bytes.values())

    @staticmethod
    def of(specs: Sequence[pb.TensorSpec], chunk_bytes: int, header_specs: bool = False) -> LogicalTensors:
        """Sizes of the tensors ``specs`` describe in chunks of ``chunk_bytes`` serialized bytes;
        with ``header_specs`` also the bytes each spec adds to a task header."""
        by_part: dict[str, int] = {}
        by_unit: dict[str, int] = {}
        sizes = stream_tensor_bytes(tuple(spec_nbytes(spec) for spec in specs), chunk_bytes)
        for spec, size in zip(specs, sizes):
            part, unit = part_and_unit(spec.name)
            by_part[part] = by_part.get(part, 0) + size
            by_unit[unit] = by_unit.get(unit, 0) + size
        spec_bytes = {spec.name: pb.TaskHeader(tensors=[spec]).ByteSize() for spec in specs} if header_specs else {}
        return LogicalTensors(by_part, by_unit, spec_bytes)


@lru_cache(maxsize=4096)
def part_and_unit(name: str) -> tuple[str, str]:
    """The part and the schedule unit of a global tensor (``other`` for both outside any unit)."""
    part = tensor_part(name)
    return part, tensor_unit(name) or part


@lru_cache(maxsize=256)
def stream_tensor_bytes(payload_bytes: tuple[int, ...], chunk_bytes: int) -> tuple[int, ...]:
    """Serialized bytes of each tensor (its pieces with their framing) in the chunk stream
    :func:`~fedpart.common.wire.tensors.encode_chunks` makes of tensors of ``payload_bytes`` bytes at
    ``chunk_bytes``, from the lengths alone: the same cuts, without the tensors."""
    sizes = []
    room = chunk_bytes
    for index, length in enumerate(payload_bytes):
        size = offset = 0
        while offset < length:
            take = _fitting_length(index, room, length - offset)
            if take == 0:
                if room == chunk_bytes:
                    raise ValueError(f"chunk_bytes {chunk_bytes} cannot hold even one framed byte")
                room = chunk_bytes
                continue
            framed = _piece_bytes(index, take)
            size += framed
            offset += take
            room -= framed
        sizes.append(size)
    return tuple(sizes)


def logical_header_bytes(header: pb.TaskHeader, missing_spec_bytes: int, result_chunk_bytes: int) -> int:
    """Serialized size of a task's first message (a TaskChunk holding ``header`` alone) had its
    header listed ``missing_spec_bytes`` more bytes of specs and named ``result_chunk_bytes``:
    what a client that holds no tensor and has a process of its own would be sent."""
    size = header.ByteSize() + missing_spec_bytes
    if result_chunk_bytes != header.result_chunk_bytes:
        size += (pb.TaskHeader(result_chunk_bytes=result_chunk_bytes).ByteSize()
                 - pb.TaskHeader(result_chunk_bytes=header.result_chunk_bytes).ByteSize())
    return _HEADER_FIELD_TAG_BYTES + varint_size(size) + size


def _key(specs: list[pb.TensorSpec]) -> tuple:
    return tuple((spec.name, spec.version) for spec in specs)


def bytes_by_part(size: ChunkBytes, parts: list[str]) -> dict[str, int]:
    """A chunk's serialized bytes (``size``) by part: tensor bytes by their tensor's part, the
    rest control."""
    by_part = {"control": size.control}
    for index, count in size.by_tensor.items():
        part = parts[index] if index < len(parts) else "control"
        by_part[part] = by_part.get(part, 0) + count
    return by_part
