"""Codecs (fedpart.common.wire.codecs): exact payload bytes on hand-computed cases, unbiased
quantization, error feedback's invariant, rejection of every malformed payload; encoded tensors on
the wire, encoded downloads, and the client's residuals across a restart."""

from __future__ import annotations

import re
import struct

import pytest
import torch

from conftest import FIXTURES, small_config
from fedpart.client.store import ClientStore
from fedpart.common.wire.codecs import (
    CodecError,
    Encoded,
    TopK,
    build_codec,
    decode,
    encode,
    encode_with_feedback,
    seeded_generator,
)
from fedpart.common.config.run_config import ConfigError, config_from_dict
from fedpart.common.wire.tensors import (
    TensorAssembler,
    WireError,
    chunk_pieces,
    decode_chunks,
    decoded_nbytes,
    encode_chunks,
    make_spec,
    measure_chunk,
    spec_nbytes,
    wire_form,
)
from fedpart.proto import fedpart_pb2 as pb
from fedpart.server.transport.transfers import TaskPayloads

SENTINEL = 12345.0


def _decoded(encoded: Encoded, like: torch.Tensor) -> torch.Tensor:
    return decode(encoded, torch.empty_like(like))


@pytest.mark.parametrize("name, dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_casts_send_two_bytes_per_element_and_round_trip(name: str, dtype: torch.dtype) -> None:
    x = torch.tensor([[1.5, -2.0], [0.25, 1024.0]])  # representable in both formats
    encoded = build_codec(name, {}).encode(x, seeded_generator(0))
    assert encoded.payload.numel() == 8
    assert bytes(encoded.payload.numpy()) == x.to(dtype).view(torch.uint8).numpy().tobytes()
    assert torch.equal(_decoded(encoded, x), x)


def test_qsgd8_hand_computed_levels_and_layout() -> None:
    # scale = max |x| = 2; |x| / 2 * 127 = 127, 0, 127 exactly: no rounding is random
    x = torch.tensor([2.0, 0.0, -2.0])
    encoded = build_codec("qsgd8", {"bucket": 4}).encode(x, seeded_generator(0))
    assert bytes(encoded.payload.numpy()) == struct.pack("<f", 2.0) + bytes([127, 0, 256 - 127])
    assert (encoded.encoding, encoded.args) == ("qsgd8", {"bucket": 3})  # no bucket beyond the tensor
    assert torch.equal(_decoded(encoded, x), x)


def test_qsgd4_packs_two_levels_per_byte() -> None:
    # levels 7, -7, 0, 7 (+ 8: nibbles 15, 1, 8, 15), bucket 3 -> two scales (1.0 and 0.5)
    x = torch.tensor([1.0, -1.0, 0.0, 0.5])
    encoded = build_codec("qsgd4", {"bucket": 3}).encode(x, seeded_generator(0))
    assert bytes(encoded.payload.numpy()) == struct.pack("<ff", 1.0, 0.5) + bytes([0x1F, 0xF8])
    assert torch.equal(_decoded(encoded, x), x)
    odd = torch.tensor([1.0, -1.0, 0.0])  # the last byte holds one level and a zero pad nibble
    encoded = build_codec("qsgd4", {"bucket": 3}).encode(odd, seeded_generator(0))
    assert bytes(encoded.payload.numpy()) == struct.pack("<f", 1.0) + bytes([0x1F, 0x08])


@pytest.mark.parametrize("name, levels", [("qsgd8", 127), ("qsgd4", 7)])
def test_qsgd_is_unbiased_and_deterministic_per_seed(name: str, levels: int) -> None:
    codec = build_codec(name, {"bucket": 16})
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    trials = 4000
    generator = seeded_generator(7)
    total = torch.zeros(64, dtype=torch.float64)
    for _ in range(trials):
        total += _decoded(codec.encode(x, generator), x)
    step = x.view(4, 16).abs().amax(dim=1).repeat_interleave(16) / levels
    # one rounding has variance <= step^2 / 4: the mean of `trials` is within 6 standard errors
    assert bool(((total / trials - x).abs() <= 6 * step / (2 * trials ** 0.5)).all())
    first = codec.encode(x, seeded_generator(1, 2, 3)).payload
    assert torch.equal(first, codec.encode(x, seeded_generator(1, 2, 3)).payload)
    assert not torch.equal(first, codec.encode(x, seeded_generator(1, 2, 4)).payload)


def test_topk_sends_sorted_indices_then_values() -> None:
    x = torch.tensor([0.1, -3.0, 2.0, 0.5])
    encoded = TopK(count=2).encode(x, seeded_generator(0))
    assert encoded.args == {"kept": 2}
    assert bytes(encoded.payload.numpy()) == struct.pack("<iiff", 1, 2, -3.0, 2.0)
    assert torch.equal(_decoded(encoded, x), torch.tensor([0.0, -3.0, 2.0, 0.0]))
    assert TopK(fraction=0.01).kept_of(1000) == 10
    assert TopK(fraction=0.01).kept_of(10) == 1


def test_error_feedback_keeps_what_was_not_sent() -> None:
    codec = TopK(fraction=0.1)
    generator = seeded_generator(0)
    residual = None
    total_delta = torch.zeros(100)
    total_sent = torch.zeros(100)
    for step in range(5):
        delta = torch.randn(100, generator=torch.Generator().manual_seed(step))
        old = torch.zeros(100) if residual is None else residual.clone()
        encoded, residual = encode_with_feedback(codec, delta, residual, generator)
        sent = _decoded(encoded, delta)
        assert int((sent != 0).sum()) == 10
        assert torch.equal(sent + residual, delta + old)  # exact: topk sends elements unchanged
        total_delta += delta
        total_sent += sent
    assert torch.allclose(total_sent + residual, total_delta, atol=1e-5)


def test_integer_tensors_travel_raw() -> None:
    assert encode(build_codec("qsgd8", {}), torch.arange(4), seeded_generator(0)) is None
    assert encode(None, torch.ones(4), seeded_generator(0)) is None


def _payload(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("encoded, out, problem", [
    (Encoded("zstd", _payload(b"\0" * 8)), torch.empty(2), "unknown encoding"),
    (Encoded("qsgd8", _payload(b"\0" * 6), {"bucket": 4}), torch.empty(2, dtype=torch.int32), "floating-point"),
    (Encoded("float16", _payload(b"\0" * 6)), torch.empty(2), "payload of 6 bytes, expected 4"),
    (Encoded("qsgd8", _payload(struct.pack("<f", float("nan")) + b"\1\1"), {"bucket": 4}), torch.empty(2), "scale"),
    (Encoded("qsgd8", _payload(struct.pack("<f", float("inf")) + b"\1\1"), {"bucket": 4}), torch.empty(2), "scale"),
    (Encoded("qsgd8", _payload(struct.pack("<f", -1.0) + b"\1\1"), {"bucket": 4}), torch.empty(2), "scale"),
    (Encoded("qsgd8", _payload(struct.pack("<f", 1.0) + b"\x80\1"), {"bucket": 4}), torch.empty(2), "-128"),
    (Encoded("qsgd8", _payload(struct.pack("<f", 1.0) + b"\1\1"), {"bucket": 0}), torch.empty(2), "bucket"),
    (Encoded("qsgd8", _payload(struct.pack("<f", 1.0) + b"\1\1"), {"kept": 1, "bucket": 4}), torch.empty(2), "kept"),
    (Encoded("qsgd4", _payload(struct.pack("<f", 1.0) + b"\x08"), {"bucket": 4}), torch.empty(2), "nibble"),
    (Encoded("qsgd4", _payload(struct.pack("<f", 1.0) + b"\x88"), {"bucket": 4}), torch.empty(1), "pad nibble"),
    (Encoded("topk", _payload(struct.pack("<iiff", 0, 4, 1, 1)), {"kept": 2}), torch.empty(4), "within [0, 4)"),
    (Encoded("topk", _payload(struct.pack("<iiff", -1, 2, 1, 1)), {"kept": 2}), torch.empty(4), "within [0, 4)"),
    (Encoded("topk", _payload(struct.pack("<iiff", 2, 2, 1, 1)), {"kept": 2}), torch.empty(4), "increase strictly"),
    (Encoded("topk", _payload(struct.pack("<iiff", 3, 1, 1, 1)), {"kept": 2}), torch.empty(4), "increase strictly"),
    (Encoded("topk", _payload(struct.pack("<iiff", 0, 1, 1, 1)), {"kept": 3}), torch.empty(2), "keeps 3 elements"),
    (Encoded("topk", _payload(struct.pack("<iiff", 0, 1, 1, 1)), {"kept": 1}), torch.empty(4), "expected 8"),
    (Encoded("topk", _payload(b""), {"kept": 0, "bucket": 2}), torch.empty(4), "bucket"),
])
def test_malformed_payloads_are_rejected_before_the_output_is_written(encoded: Encoded, out: torch.Tensor,
                                                                      problem: str) -> None:
    out.fill_(SENTINEL if out.is_floating_point() else 7)
    before = out.clone()
    with pytest.raises(CodecError, match=re.escape(problem)):
        decode(encoded, out)
    assert torch.equal(out, before)


# ---------------------------------------------------------------- on the wire


def _encoded_message(tensors: dict[str, torch.Tensor], codec_name: str, options: dict,
                     chunk_bytes: int = 64) -> list[pb.ResultChunk]:
    codec = build_codec(codec_name, options)
    generator = seeded_generator(0)
    forms = [wire_form(name, t, encode(codec, t, generator)) for name, t in tensors.items()]
    header = pb.ResultHeader(tensors=[spec for spec, _ in forms])
    return [pb.ResultChunk.FromString(c.SerializeToString())
            for c in encode_chunks(pb.ResultChunk, header, [payload for _, payload in forms], chunk_bytes)]


def test_encoded_tensors_cross_the_wire_and_are_counted_by_encoding() -> None:
    tensors = {"w": torch.randn(10, 30), "steps": torch.arange(3)}  # the integer tensor stays raw
    chunks = _encoded_message(tensors, "topk", {"count": 25})
    w_spec, steps_spec = chunks[0].header.tensors
    assert (w_spec.encoding, w_spec.codec_args["kept"], w_spec.dtype, list(w_spec.shape)) == ("topk", 25, "float32", [10, 30])
    assert steps_spec.encoding == ""
    assert spec_nbytes(w_spec) == 25 * 8 and decoded_nbytes(w_spec) == 1200
    staging = {"w": torch.full((10, 30), SENTINEL)}  # a server's reused buffer: fully overwritten
    assembler = TensorAssembler(chunks[0].header.tensors, into=staging)
    for chunk in chunks:
        assembler.add(chunk_pieces(chunk))
    got = assembler.tensors()
    assert got["w"] is staging["w"] and torch.equal(got["steps"], tensors["steps"])
    assert int((got["w"] != 0).sum()) == 25
    assert torch.equal(got["w"][got["w"] != 0], tensors["w"][got["w"] != 0])
    wire = sum(measure_chunk(c).total - measure_chunk(c).control for c in chunks)
    counts = assembler.encoding_bytes()
    assert {encoding: count["raw"] for encoding, count in counts.items()} == {"topk": 1200, "none": 24}
    assert counts["topk"]["wire"] + counts["none"]["wire"] == wire
    assert 200 < counts["topk"]["wire"] < 240  # 200 payload bytes + framing of a few pieces


@pytest.mark.parametrize("changes, problem", [
    ({"encoding": "zstd"}, "unknown encoding"),
    ({"encoding": "topk", "codec_args": {"kept": 7}}, "keeps 7 elements of a tensor of 6"),
    ({"encoding": "qsgd8", "codec_args": {"bucket": 0}}, "bucket of at least 1"),
    ({"codec_args": {"kept": 2}}, "without an encoding"),
    ({"encoding": "float16", "dtype": "int64"}, "floating-point"),
])
def test_bad_encoding_fields_are_refused_before_any_piece(changes: dict, problem: str) -> None:
    spec = pb.TensorSpec(name="w", dtype="float32", shape=[2, 3])
    for field, value in changes.items():
        if field == "codec_args":
            spec.codec_args.update(value)
        else:
            setattr(spec, field, value)
    with pytest.raises(WireError, match=re.escape(problem)):
        TensorAssembler([spec])


def test_a_bad_payload_is_a_wire_error_naming_the_tensor() -> None:
    chunks = _encoded_message({"w": torch.randn(8)}, "qsgd8", {"bucket": 4})
    chunks[-1].pieces[-1].data = chunks[-1].pieces[-1].data[:-1] + b"\x80"  # level -128
    with pytest.raises(WireError, match="tensor 'w': .*-128"):
        decode_chunks(chunks)


def test_the_size_limit_bounds_decoded_bytes_too() -> None:
    huge = pb.TensorSpec(name="w", dtype="float32", shape=[1 << 30], encoding="topk", codec_args={"kept": 1})
    assert spec_nbytes(huge) == 8
    with pytest.raises(WireError, match="decoded bytes"):
        TensorAssembler([huge], max_total_bytes=1 << 20)


def test_downloads_are_encoded_once_per_version() -> None:
    payloads = TaskPayloads(chunk_bytes=4096, codec=build_codec("qsgd8", {}), seed=1)
    tensor = torch.randn(3000)
    spec = make_spec("body.w", tensor, version=2)
    specs, sent = payloads.wire_forms([spec], [tensor])
    assert specs[0].encoding == "qsgd8" and sent[0].numel() == 3 * 4 + 3000
    assert payloads.wire_forms([spec], [tensor])[1][0] is sent[0]
    newer = make_spec("body.w", tensor, version=3)
    assert payloads.wire_forms([newer], [tensor])[1][0] is not sent[0]
    header = pb.TaskChunk(header=pb.TaskHeader(tensors=specs))
    chunks = payloads.chunks(specs, sent, ["body"])
    _, decoded = decode_chunks([header, *(pb.TaskChunk.FromString(serialized) for serialized, _ in chunks)])
    assert (decoded["body.w"] - tensor).abs().max() <= tensor.abs().max() / 127 + 1e-6
    counts = payloads.encoding_bytes(specs)
    assert counts["qsgd8"]["raw"] == 12_000
    assert counts["qsgd8"]["wire"] == sum(by_part["body"] for _, by_part in chunks)


def test_a_plug_in_codec_with_a_parameter_crosses_the_wire_without_a_proto_change(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    config = config_from_dict(small_config(compression={"up": {"codec": "plugin_codec:fixed_point",
                                                               "fraction_bits": 4}}))
    x = torch.tensor([[0.3, -1.26], [2.0, 0.03]])
    chunks = _encoded_message({"w": x}, config.compression.up.codec, config.compression.up.options)
    (spec,) = chunks[0].header.tensors
    assert (spec.encoding, dict(spec.codec_args), spec_nbytes(spec)) == ("fixed_point", {"fraction_bits": 4}, 16)
    _, decoded = decode_chunks(chunks)
    assert torch.equal(decoded["w"], (x * 16).round() / 16)
    with pytest.raises(ConfigError, match=re.escape("compression.up.fraction_bits must be in [0, 24]")):
        config_from_dict(small_config(compression={"up": {"codec": "plugin_codec:fixed_point", "fraction_bits": 30}}))
    with pytest.raises(ConfigError, match="'plugin_optimizer:signed' is not a codec"):
        config_from_dict(small_config(compression={"up": {"codec": "plugin_optimizer:signed"}}))


REQUIRED_OPTION_CODEC = """
from fedpart.api import CODECS, Component, Option


class Scaled:
    name, sparse, error_feedback, wire_args = "scaled_required", False, False, ()

    def __init__(self, scale):
        self.scale = scale


made_directly = Component("scaled_required", "A codec whose scale has no default.", Scaled,
                          (Option("scale", float),), kind="codec")
"""


def test_a_codec_option_without_a_default_is_refused_where_the_codec_is_made(tmp_path, monkeypatch) -> None:
    """The receiver builds a decoder from the codec's defaults (CODECS[encoding]()), so a codec
    option without one would fail decoding with a TypeError: the registry refuses such a codec when
    it is made by CODECS.component, and a Component made otherwise when a run config names it."""
    from fedpart.common.components.registry import CODECS, Option, OptionError

    class Scaled:
        def __init__(self, scale: float) -> None:
            self.scale = scale

    with pytest.raises(OptionError) as error:
        CODECS.component("scaled", "A codec whose scale has no default.", Scaled, Option("scale", float))
    assert str(error.value).startswith("codec 'scaled': option 'scale' has no default, and every option of a codec "
                                       "needs one: the receiver builds its decoder from the defaults")
    assert CODECS.component("scaled", "With a default.", Scaled, Option("scale", float, default=1.0))().scale == 1.0
    (tmp_path / "required_option_codec.py").write_text(REQUIRED_OPTION_CODEC)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="codec 'scaled_required': option 'scale' has no default"):
        config_from_dict(small_config(compression={"up": {"codec": "required_option_codec:made_directly",
                                                          "scale": 2.0}}))
    assert "scaled_required" not in CODECS


def test_a_decoder_that_cannot_be_built_from_the_defaults_is_a_codec_error(monkeypatch) -> None:
    """Whatever a codec's builder raises when the receiver builds its decoder is a CodecError (a
    refused payload), never a TypeError out of the receiver."""
    from fedpart.common.wire import codecs
    from fedpart.common.components.registry import CODECS

    def broken() -> None:
        raise TypeError("broken() missing 1 required positional argument: 'scale'")

    component = CODECS.component("broken_defaults", "Cannot be built from its defaults.", broken)
    monkeypatch.setitem(CODECS._plugins, "broken_defaults", component)
    encoded = Encoded("broken_defaults", torch.zeros(4, dtype=torch.uint8), {})
    with pytest.raises(CodecError, match=re.escape("encoding 'broken_defaults': the decoder cannot be built from the "
                                                   "codec's defaults (TypeError: broken() missing 1")):
        decode(encoded, torch.empty(1))
    assert "broken_defaults" not in codecs._DECODERS


def test_an_encoding_named_by_a_path_is_never_imported_from_the_wire() -> None:
    spec = pb.TensorSpec(name="w", dtype="float32", shape=[2], encoding="plugin_codec:unconfigured")
    with pytest.raises(WireError, match="unknown encoding"):
        TensorAssembler([spec])


# ---------------------------------------------------------------- residuals on the client


def test_residuals_survive_a_restart_and_a_redone_round_starts_from_its_own(tmp_path) -> None:
    first = ClientStore(tmp_path, "run-1")
    first.save_residuals(3, 1, {"body.w": torch.tensor([1.0, 2.0])})
    first.save_residuals(3, 2, {"body.w": torch.tensor([5.0, 6.0])})
    restarted = ClientStore(tmp_path, "run-1")  # a new client process on the same state dir
    assert torch.equal(restarted.residuals(3, 3)["body.w"], torch.tensor([5.0, 6.0]))
    assert torch.equal(restarted.residuals(3, 2)["body.w"], torch.tensor([1.0, 2.0]))  # round 2 redone
    assert restarted.residuals(4, 3) == {}
    assert restarted.personal_parts(3) == []  # residuals are not personal parts
