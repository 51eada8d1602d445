"""Tensors on the wire: chunked raw little-endian round trips, exact byte attribution, validation."""

from __future__ import annotations

import pytest
import torch

from fedpart.common.wire import tensors as wire
from fedpart.common.wire.tensors import (
    TensorAssembler,
    WireError,
    chunk_pieces,
    decode_chunks,
    encode_chunks,
    header_then_pieces,
    measure_chunk,
    named_specs,
    serialized_pieces,
    varint_size,
)
from fedpart.proto import fedpart_pb2 as pb

MIB = 1 << 20
GRPC_DEFAULT_LIMIT = 4 * MIB


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """An integer view of the tensor's bytes, for bit-exact comparisons (NaN payloads included)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _assert_bit_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(_bits(got), _bits(want))


def _sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 65504.0])
    return {
        "f32": base,
        "f32_special": special,
        "f16": torch.cat([base.reshape(-1), special]).to(torch.float16),
        "bf16": torch.cat([base.reshape(-1), special]).to(torch.bfloat16),
        "f64": torch.randn(3, generator=gen, dtype=torch.float64),
        "i64": torch.tensor([0, 1, -1, 2**62, -(2**63), 2**63 - 1], dtype=torch.int64),
        "i32": torch.tensor([[7, -8], [2**31 - 1, -(2**31)]], dtype=torch.int32),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "empty_i64": torch.empty(3, 0, 2, dtype=torch.int64),
        "noncontig": torch.arange(24, dtype=torch.float32).reshape(4, 6).t()[1:, ::2],
    }


def _result_header(tensors: dict[str, torch.Tensor]) -> pb.ResultHeader:
    header = pb.ResultHeader(session="s-1", task_id=42, client_id=7, round=3, num_samples=123,
                             tensors=named_specs(tensors))
    header.metrics["loss"] = 0.5
    return header


@pytest.mark.parametrize("chunk_bytes", [7, 1024, wire.DEFAULT_CHUNK_BYTES])
def test_result_round_trip_all_dtypes_bit_identical(chunk_bytes):
    tensors = _sample_tensors()
    assert not tensors["noncontig"].is_contiguous()
    header = _result_header(tensors)
    chunks = list(encode_chunks(pb.ResultChunk, header, tensors.values(), chunk_bytes=chunk_bytes))
    assert chunks[0].HasField("header")
    assert all(not c.HasField("header") for c in chunks[1:])
    # Each chunk passes through real protobuf serialization.
    parsed = [pb.ResultChunk.FromString(c.SerializeToString()) for c in chunks]
    got_header, got = decode_chunks(parsed)
    assert got_header == header
    assert list(got) == list(tensors)
    for name, tensor in tensors.items():
        _assert_bit_identical(got[name], tensor)
    assert got["scalar"].dim() == 0
    assert got["empty"].shape == (0, 4)
    assert got["empty_i64"].shape == (3, 0, 2)
    assert got["noncontig"].is_contiguous()


def test_header_then_pieces_sends_the_header_alone_in_as_many_bytes():
    tensors = _sample_tensors()
    header = _result_header(tensors)
    together = list(encode_chunks(pb.ResultChunk, header, tensors.values(), chunk_bytes=1024))
    apart = list(header_then_pieces(pb.ResultChunk, header, tensors.values(), chunk_bytes=1024))
    assert apart[0] == pb.ResultChunk(header=header)
    assert all(not c.HasField("header") and c.pieces for c in apart[1:])
    assert sum(c.ByteSize() for c in apart) == sum(c.ByteSize() for c in together)
    got_header, got = decode_chunks([pb.ResultChunk.FromString(c.SerializeToString()) for c in apart])
    assert got_header == header
    for name, tensor in tensors.items():
        _assert_bit_identical(got[name], tensor)


@pytest.mark.parametrize("chunk_bytes", [16, 300, 1024, wire.DEFAULT_CHUNK_BYTES])
def test_serialized_pieces_are_what_protobuf_writes_for_the_chunks(chunk_bytes):
    tensors = list(_sample_tensors().values()) + [torch.full((70,), 2.5)] * 140  # indices past one varint byte
    want = [c.SerializeToString() for c in encode_chunks(pb.ResultChunk, None, tensors, chunk_bytes)]
    got = list(serialized_pieces(tensors, chunk_bytes))
    assert got == want
    assert got == [c.SerializeToString() for c in encode_chunks(pb.TaskChunk, None, tensors, chunk_bytes)]
    assert all(len(message) <= chunk_bytes for message in got)


def test_task_round_trip_with_versions_and_plan():
    tensors = {"body.fc1.1.weight": torch.randn(4, 3), "head.bias": torch.zeros(2, dtype=torch.float16)}
    header = pb.TaskHeader(kind=pb.TRAIN, task_id=9, round=2, client_id=5,
                           tensors=named_specs(tensors, {"body.fc1.1.weight": 2}), personal_init=["head"])
    header.train.lr = 0.1
    header.train.upload_deltas.extend(["body.fc1.1.weight"])
    header.train.phases.add(epochs=2, trainable=["fc1", "head"], params={"unfreeze_fraction": 0.5})
    chunks = [pb.TaskChunk.FromString(c.SerializeToString())
              for c in encode_chunks(pb.TaskChunk, header, tensors.values(), chunk_bytes=16)]
    assert len(chunks) > 1
    got_header, got = decode_chunks(chunks)
    assert got_header.train.phases[0].trainable == ["fc1", "head"]
    assert [s.version for s in got_header.tensors] == [2, 0]
    for name, tensor in tensors.items():
        _assert_bit_identical(got[name], tensor)


def test_bytes_are_raw_little_endian():
    header = pb.ResultHeader(tensors=named_specs({"x": torch.tensor([1.0])}))
    (chunk,) = encode_chunks(pb.ResultChunk, header, [torch.tensor([1.0])])
    assert chunk.pieces[0].data == b"\x00\x00\x80?"
    ints = torch.tensor([1, 256], dtype=torch.int32)
    header = pb.ResultHeader(tensors=named_specs({"i": ints}))
    (chunk,) = encode_chunks(pb.ResultChunk, header, [ints])
    assert chunk.pieces[0].data == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    half = torch.tensor([1.0], dtype=torch.bfloat16)
    header = pb.ResultHeader(tensors=named_specs({"h": half}))
    (chunk,) = encode_chunks(pb.ResultChunk, header, [half])
    assert chunk.pieces[0].data == b"\x80?"


def test_large_tensor_is_chunked_under_grpc_limit():
    big = torch.randn(1_500_000, generator=torch.Generator().manual_seed(1))  # 6 MB > 4 MiB
    small = torch.arange(10, dtype=torch.int64)
    tensors = {"big": big, "small": small, "scalar": torch.tensor(True)}
    header = _result_header(tensors)
    chunk_bytes = MIB
    chunks = list(encode_chunks(pb.ResultChunk, header, tensors.values(), chunk_bytes=chunk_bytes))
    total_payload = sum(t.numel() * t.element_size() for t in tensors.values())
    assert len(chunks) == -(-total_payload // chunk_bytes)  # ceil: every chunk but the last is full
    overhead = header.ByteSize() + 64
    for chunk in chunks:
        size = chunk.ByteSize()
        assert size <= chunk_bytes + overhead
        assert size < GRPC_DEFAULT_LIMIT
        assert sum(len(p.data) for p in chunk.pieces) <= chunk_bytes
    _, got = decode_chunks(pb.ResultChunk.FromString(c.SerializeToString()) for c in chunks)
    for name, tensor in tensors.items():
        _assert_bit_identical(got[name], tensor)


def test_measure_chunk_attributes_every_byte():
    tensors = {"big": torch.randn(300_000), "mid": torch.randn(1000, dtype=torch.float64),
               "tiny": torch.tensor([1, 2, 3], dtype=torch.int8), "empty": torch.empty(0),
               "last": torch.ones(5, dtype=torch.bfloat16)}
    header = _result_header(tensors)
    chunks = list(encode_chunks(pb.ResultChunk, header, tensors.values(), chunk_bytes=100_000))
    per_tensor = [0] * len(tensors)
    pieces_per_tensor = [0] * len(tensors)
    total = 0
    for position, chunk in enumerate(chunks):
        measured = measure_chunk(chunk)
        size = len(chunk.SerializeToString())
        assert measured.total == chunk.ByteSize() == size
        assert sum(measured.by_tensor.values()) + measured.control == size
        if position == 0:
            # Control bytes of the first chunk are exactly the framed header.
            hsize = header.ByteSize()
            assert measured.control == 1 + varint_size(hsize) + hsize
        else:
            assert measured.control == 0
        for index, nbytes in measured.by_tensor.items():
            per_tensor[index] += nbytes
        for piece in chunk.pieces:
            pieces_per_tensor[piece.index] += 1
        total += size
    for index, tensor in enumerate(tensors.values()):
        nbytes = tensor.numel() * tensor.element_size()
        framing = per_tensor[index] - nbytes
        assert 0 <= framing <= 12 * pieces_per_tensor[index]
        if nbytes:
            assert framing >= 3 * pieces_per_tensor[index]
    assert per_tensor[3] == 0  # the empty tensor costs only its spec in the header
    assert total == sum(c.ByteSize() for c in chunks)


@pytest.mark.parametrize("chunk_type, header_type", [(pb.ResultChunk, pb.ResultHeader), (pb.TaskChunk, pb.TaskHeader)])
def test_read_chunk_gives_what_protobuf_parses_with_views_of_the_bytes(chunk_type, header_type):
    tensors = {"big": torch.randn(30_000), "tiny": torch.tensor([1, 2, 3], dtype=torch.int8),
               "empty": torch.empty(0), "last": torch.ones(5, dtype=torch.bfloat16)}
    header = header_type(tensors=named_specs(tensors))
    for stream in (encode_chunks(chunk_type, header, tensors.values(), chunk_bytes=10_000),
                   header_then_pieces(chunk_type, header, tensors.values(), chunk_bytes=10_000)):
        for message in stream:
            serialized = message.SerializeToString()
            chunk = wire.read_chunk(header_type, serialized)
            assert not chunk.malformed
            assert chunk.header == (message.header if message.HasField("header") else None)
            assert [(index, bytes(data)) for index, data in chunk.pieces] == chunk_pieces(message)
            assert all(data.obj is serialized for _, data in chunk.pieces)  # views, not copies
            assert chunk.size == measure_chunk(message)


def test_read_chunk_merges_repeated_headers_and_counts_unknown_fields_as_control():
    first = pb.ResultChunk(header=pb.ResultHeader(session="s", task_id=4)).SerializeToString()
    second = pb.ResultChunk(header=pb.ResultHeader(client_id=9)).SerializeToString()
    piece = pb.ResultChunk(pieces=[pb.TensorPiece(index=1, data=b"abcd")]).SerializeToString()
    merged = wire.read_chunk(pb.ResultHeader, first + piece + second)
    assert merged.header == pb.ResultChunk.FromString(first + piece + second).header
    assert merged.pieces == [(1, memoryview(b"abcd"))]
    unknown = b"\x18\x05" + b"\x21" + bytes(8) + b"\x2d" + bytes(4) + b"\x22\x01x"  # fields 3-5, every wire type
    extra = wire.read_chunk(pb.ResultHeader, piece + unknown)
    assert extra.pieces == [(1, memoryview(b"abcd"))] and extra.size.control == len(unknown)
    explicit_zero = b"\x12\x05\x08\x00\x12\x01z"  # index 0 written out: not protobuf's own encoding
    assert wire.read_chunk(pb.ResultHeader, explicit_zero).size.control == 2


@pytest.mark.parametrize("garbage, reason", [
    (b"\x12\x05\x08", "runs past the end"),
    (b"\x12" + b"\xff" * 11, "longer than 10 bytes"),
    (b"\x0a\x02\xff\xff", "ResultHeader"),
    (b"\x13\x14", "wire type 3"),
    (b"\x00", "field number 0"),
    (b"\x12\x07\x08\x80\x80\x80\x80\x10\x12", "does not fit in 32 bits"),
    (b"\x19\x00", "runs past the end"),
])
def test_read_chunk_says_why_bytes_are_not_a_chunk_and_raises_nothing(garbage, reason):
    chunk = wire.read_chunk(pb.ResultHeader, garbage)
    assert reason in chunk.malformed and chunk.header is None and chunk.pieces == []
    assert chunk.size.total == len(garbage) == chunk.size.control


@pytest.mark.parametrize("index", [0, 1, 127, 128, 70_000])
@pytest.mark.parametrize("length", [1, 127, 128, 20_000])
def test_piece_wire_bytes_is_exact(index, length):
    piece = pb.TensorPiece(index=index, data=bytes(length))
    for chunk in (pb.ResultChunk(pieces=[piece]), pb.TaskChunk(pieces=[piece])):
        size = measure_chunk(chunk)
        assert size.by_tensor == {index: chunk.ByteSize()} and size.control == 0
        assert measure_chunk(chunk, chunk_pieces(chunk)) == size


def test_no_tensors_gives_single_header_chunk():
    header = pb.ResultHeader(client_id=1, num_samples=5)
    chunks = list(encode_chunks(pb.ResultChunk, header, []))
    assert len(chunks) == 1 and chunks[0].HasField("header") and not chunks[0].pieces
    got_header, got = decode_chunks(chunks)
    assert got_header.num_samples == 5 and got == {}


def test_chunk_bytes_must_be_positive():
    with pytest.raises(ValueError):
        list(encode_chunks(pb.ResultChunk, pb.ResultHeader(), [torch.ones(1)], chunk_bytes=0))


def _spec(name="x", dtype="float32", shape=(2,)):
    return pb.TensorSpec(name=name, dtype=dtype, shape=list(shape))


def test_assembler_rejects_too_many_bytes():
    assembler = TensorAssembler([_spec()])
    assembler.add([(0, bytes(4))])
    with pytest.raises(WireError, match="more bytes"):
        assembler.add([(0, bytes(8))])


def test_assembler_rejects_too_few_bytes():
    assembler = TensorAssembler([_spec(), _spec("y", "int64", (1,))])
    assembler.add([(0, bytes(8)), (1, bytes(4))])
    with pytest.raises(WireError, match="'y': got 4 of 8"):
        assembler.tensors()


def test_assembler_rejects_out_of_range_index():
    assembler = TensorAssembler([_spec()])
    with pytest.raises(WireError, match="index 1"):
        assembler.add([(1, bytes(4))])


@pytest.mark.parametrize("dtype", ["complex64", "float", "torch.float32", ""])
def test_assembler_rejects_unknown_dtype(dtype):
    with pytest.raises(WireError, match="unknown dtype"):
        TensorAssembler([_spec(dtype=dtype)])


def test_assembler_rejects_negative_dimension():
    with pytest.raises(WireError, match="negative"):
        TensorAssembler([_spec(shape=(2, -1))])


def test_assembler_rejects_duplicate_names():
    with pytest.raises(WireError, match="duplicate"):
        TensorAssembler([_spec("a"), _spec("b"), _spec("a")])


def test_assembler_rejects_declared_size_above_limit():
    specs = [_spec("a", shape=(100,)), _spec("b", shape=(100,))]  # 800 bytes
    TensorAssembler(specs, max_total_bytes=800)
    with pytest.raises(WireError, match="800"):
        TensorAssembler(specs, max_total_bytes=799)
    # Declared sizes are checked before any buffer is allocated: a huge declaration is cheap to refuse.
    with pytest.raises(WireError):
        TensorAssembler([_spec(shape=(1 << 40, 1 << 20))], max_total_bytes=1 << 30)


def test_decode_rejects_declared_size_above_limit():
    tensors = {"x": torch.ones(100)}
    chunks = list(encode_chunks(pb.ResultChunk, _result_header(tensors), tensors.values()))
    with pytest.raises(WireError):
        decode_chunks(chunks, max_total_bytes=399)
    _, got = decode_chunks(chunks, max_total_bytes=400)
    assert torch.equal(got["x"], tensors["x"])


def test_decode_rejects_empty_stream():
    with pytest.raises(WireError, match="empty"):
        decode_chunks([])
    with pytest.raises(WireError, match="empty"):
        decode_chunks(iter(()))


def test_decode_rejects_first_chunk_without_header():
    with pytest.raises(WireError, match="no header"):
        decode_chunks([pb.ResultChunk(pieces=[pb.TensorPiece(index=0, data=b"abcd")])])


def test_decode_rejects_second_header():
    tensors = {"x": torch.ones(4)}
    header = _result_header(tensors)
    chunks = list(encode_chunks(pb.ResultChunk, header, tensors.values(), chunk_bytes=12))  # 8 data bytes + 4 of framing per chunk
    assert len(chunks) == 2
    chunks[1].header.CopyFrom(header)
    with pytest.raises(WireError, match="second header"):
        decode_chunks(chunks)


def test_decode_rejects_truncated_stream():
    tensors = {"x": torch.ones(4)}
    chunks = list(encode_chunks(pb.ResultChunk, _result_header(tensors), tensors.values(), chunk_bytes=12))  # 8 data bytes + 4 of framing per chunk
    with pytest.raises(WireError, match="got 8 of 16"):
        decode_chunks(chunks[:1])


def test_unsupported_dtype_cannot_be_encoded():
    with pytest.raises(WireError):
        wire.make_spec("c", torch.zeros(2, dtype=torch.complex64))


def test_chunk_size_bounded_for_many_small_tensors():
    tensors = {f"t{i}": torch.tensor([i % 7], dtype=torch.int8) for i in range(3000)}
    header = _result_header(tensors)
    chunk_bytes = 1024
    chunks = list(encode_chunks(pb.ResultChunk, header, tensors.values(), chunk_bytes=chunk_bytes))
    _, got = decode_chunks(chunks)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
    for position, chunk in enumerate(chunks):
        allowance = 64 + (header.ByteSize() + 8 if position == 0 else 0)
        assert chunk.ByteSize() <= chunk_bytes + allowance


def _assemble(chunks, into=None, max_total_bytes=None) -> dict[str, torch.Tensor]:
    assembler = TensorAssembler(chunks[0].header.tensors, max_total_bytes, into=into)
    for chunk in chunks:
        assembler.add(chunk_pieces(chunk))
    return assembler.tensors()


def _mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 7, generator=gen),
            "half": torch.randn(33, generator=gen).to(torch.bfloat16),
            "steps": torch.randint(-2**40, 2**40, (5,), generator=gen),
            "mask": torch.rand(9, generator=gen) > 0.5,
            "scalar": torch.tensor(float(seed) + 0.25, dtype=torch.float64),
            "empty": torch.empty(0, 4)}


def _staging_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Buffers of the right kind holding stale bytes (0xA5 everywhere), as a reused pool would."""
    staging = {name: torch.empty_like(tensor) for name, tensor in tensors.items()}
    for buffer in staging.values():
        buffer.view(-1).view(torch.uint8).fill_(0xA5)
    return staging


def test_assembler_fills_caller_buffers_and_reuses_them_across_results():
    staging = _staging_like(_mixed_tensors(0))
    for seed in (1, 2):  # the same buffers take a second result, with other values
        tensors = _mixed_tensors(seed)
        chunks = list(encode_chunks(pb.ResultChunk, _result_header(tensors), tensors.values(), chunk_bytes=1000))
        assert len(chunks) > 3
        got = _assemble(chunks, into=staging)
        assert list(got) == list(tensors)
        for name, tensor in tensors.items():
            assert got[name] is staging[name]
            assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype
            assert torch.equal(_bits(got[name]), _bits(tensor))


def test_assembler_allocates_what_the_caller_buffers_do_not_cover():
    tensors = {"a": torch.arange(6.0), "b": torch.arange(4, dtype=torch.int32)}
    chunks = list(encode_chunks(pb.ResultChunk, _result_header(tensors), tensors.values()))
    spare = torch.full((3,), 7.0)
    staging = {"a": torch.zeros(6), "not_sent": spare}
    got = _assemble(chunks, into=staging)
    assert got["a"] is staging["a"] and torch.equal(got["a"], tensors["a"])
    assert torch.equal(got["b"], tensors["b"]) and got["b"].data_ptr() != tensors["b"].data_ptr()
    assert set(got) == {"a", "b"} and torch.equal(spare, torch.full((3,), 7.0))


@pytest.mark.parametrize("buffer, problem", [
    (torch.zeros(6, dtype=torch.float64), "dtype torch.float64, the message declares torch.float32"),
    (torch.zeros(2, 3), r"shape \[2, 3\], the message declares \[6\]"),
    (torch.zeros(12)[::2], "not contiguous"),
    (torch.zeros(6, requires_grad=True), "requires grad"),
], ids=["dtype", "shape", "strided", "grad"])
def test_assembler_refuses_a_caller_buffer_that_does_not_match(buffer, problem):
    spec = _spec("a", "float32", (6,))
    with pytest.raises(WireError, match=rf"'a': the buffer to assemble it into has {problem}"):
        TensorAssembler([spec], into={"a": buffer})


def test_assembler_refuses_overlapping_caller_buffers():
    pool = torch.zeros(10)
    specs = [_spec("a", shape=(6,)), _spec("b", shape=(4,))]
    TensorAssembler(specs, into={"a": pool[:6], "b": pool[6:]})  # adjacent, not overlapping
    with pytest.raises(WireError, match="'a' and 'b'.*overlapping"):
        TensorAssembler(specs, into={"a": pool[:6], "b": pool[5:9]})


def test_assembler_into_caller_buffers_keeps_every_check():
    tensors = {"x": torch.ones(4)}
    chunks = list(encode_chunks(pb.ResultChunk, _result_header(tensors), tensors.values(), chunk_bytes=12))
    staging = {"x": torch.zeros(4)}
    with pytest.raises(WireError, match="got 8 of 16"):
        _assemble(chunks[:1], into=staging)
    with pytest.raises(WireError, match="15"):
        _assemble(chunks, into=staging, max_total_bytes=15)
    assembler = TensorAssembler(chunks[0].header.tensors, into=staging)
    assembler.add(chunk_pieces(chunks[0]))
    with pytest.raises(WireError, match="more bytes"):
        assembler.add([*chunk_pieces(chunks[0]), *chunk_pieces(chunks[1])])
    with pytest.raises(WireError, match="index 1"):
        assembler.add([(1, bytes(4))])
