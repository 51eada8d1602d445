"""Codecs: how a floating-point tensor is encoded for the wire and decoded on arrival.

A codec turns a tensor into a flat little-endian byte payload plus the :class:`Encoded` fields a
``TensorSpec`` carries: ``encoding`` (the codec's name) and ``codec_args``, the integer arguments
the codec declares in ``wire_args`` (qsgd's ``bucket``, topk's ``kept``); the spec's dtype and
shape always describe the decoded tensor. The payload size follows from the spec alone
(:func:`payload_nbytes`), so a receiver bounds and checks it before reading a byte, and
:func:`decode` validates every field of the payload (index range and order, level range, finite
scales) before it writes the decoded tensor. Raw tensors (encoding ``""``) never come here.

- ``float16`` / ``bfloat16``: casts.
- ``qsgd8`` / ``qsgd4``: unbiased stochastic uniform quantization with one scale (the largest
  magnitude) per bucket of elements (QSGD, Alistarh et al., NeurIPS 2017, with the max-norm scale
  of TernGrad, Wen et al., NeurIPS 2017); 4-bit levels are packed two per byte.
- ``topk``: the largest-magnitude fraction (or count) of the elements as sorted (index, value)
  pairs, used with error feedback (:func:`encode_with_feedback`; Stich et al., "Sparsified SGD
  with memory", NeurIPS 2018).

Codecs are components of :data:`fedpart.common.components.registry.CODECS`: a new codec, with options and
wire arguments of its own, is one module that registers a :class:`~fedpart.common.components.registry.Component`
(or one that a run config names by ``package.module:name``); no proto change.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from fedpart.common.components.registry import CODECS, Option
from fedpart.proto import fedpart_pb2 as pb

DEFAULT_BUCKET = 1024  # elements per qsgd scale: 4 bytes of scale per 1,024 elements (0.4% at 8 bits)
MAX_TOPK_ELEMENTS = 1 << 31  # indices travel as int32
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_LITTLE_ENDIAN = sys.byteorder == "little"


class CodecError(ValueError):
    """An encoded payload or its spec fields that cannot be decoded (the message says why)."""


@dataclass(frozen=True)
class Encoded:
    """A tensor's wire payload (1-D uint8, little-endian) and the spec fields that describe it."""

    encoding: str
    payload: torch.Tensor
    args: Mapping[str, int] = field(default_factory=dict)  # the codec's wire arguments

    def fill(self, spec: pb.TensorSpec) -> pb.TensorSpec:
        """Write the encoding fields into ``spec`` (which describes the decoded tensor)."""
        spec.encoding = self.encoding
        spec.codec_args.update(self.args)
        return spec


class Codec(Protocol):
    """Encodes floating-point tensors; decodes payloads of its encoding."""

    name: str             # the encoding on the wire: the codec's component name
    sparse: bool          # drops elements: applies to deltas only (a value would lose them)
    error_feedback: bool  # keep what was not sent and add it to the next delta
    lossless: bool        # decodes every element exactly (optional: a codec without it is lossy, see lossless())
    wire_args: ClassVar[tuple[str, ...]]  # the integer arguments its payloads carry (0 when absent)

    def encode(self, tensor: torch.Tensor, generator: torch.Generator) -> Encoded: ...

    def payload_nbytes(self, dtype: torch.dtype, numel: int, args: Mapping[str, int]) -> int:
        """The exact payload size; ``args`` holds every name of ``wire_args``."""

    def decode(self, encoded: Encoded, out: torch.Tensor) -> None: ...


def _to_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as little-endian bytes (a view on little-endian hosts)."""
    flat = tensor.contiguous().reshape(-1)
    if not _LITTLE_ENDIAN and flat.element_size() > 1:
        return flat.view(torch.uint8).view(-1, flat.element_size()).flip(1).reshape(-1)
    return flat.view(torch.uint8)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Little-endian bytes as elements of ``dtype`` (copied only when misaligned or big-endian)."""
    size = dtype.itemsize
    if data.storage_offset() % size:
        data = data.clone()
    if not _LITTLE_ENDIAN and size > 1:
        data = data.view(-1, size).flip(1).reshape(-1)
    return data.view(dtype)


class Cast:
    """The tensor cast to a narrower float type."""

    sparse = False
    error_feedback = False
    lossless = False
    wire_args = ()

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def encode(self, tensor: torch.Tensor, generator: torch.Generator) -> Encoded:
        return Encoded(self.name, _to_bytes(tensor.detach().to(self.dtype)))

    def payload_nbytes(self, dtype: torch.dtype, numel: int, args: Mapping[str, int]) -> int:
        return numel * self.dtype.itemsize

    def decode(self, encoded: Encoded, out: torch.Tensor) -> None:
        out.view(-1).copy_(_from_bytes(encoded.payload, self.dtype))


class Qsgd:
    """Stochastic uniform quantization to ``2**(bits-1) - 1`` levels per sign: within a bucket of
    scale s = max |x|, x is sent as level l = floor(|x|/s*L) + Bernoulli(frac) with x's sign, so
    that E[l * s / L] = x. 8-bit levels are int8 in [-127, 127]; 4-bit levels l in [-7, 7] are
    stored as l + 8 in a nibble (low nibble first; a pad nibble is 0, never a level).
    Payload: float32 scale per bucket, then the levels."""

    sparse = False
    error_feedback = False
    lossless = False
    wire_args = ("bucket",)

    def __init__(self, bits: int, bucket: int = DEFAULT_BUCKET) -> None:
        self.name = f"qsgd{bits}"
        self.bits = bits
        self.levels = (1 << (bits - 1)) - 1
        self.bucket = bucket

    def _level_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def payload_nbytes(self, dtype: torch.dtype, numel: int, args: Mapping[str, int]) -> int:
        bucket = args["bucket"]
        if bucket < 1:
            raise CodecError(f"encoding {self.name!r} needs a bucket of at least 1 element, got {bucket}")
        return 4 * -(-numel // bucket) + self._level_bytes(numel)

    def encode(self, tensor: torch.Tensor, generator: torch.Generator) -> Encoded:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        numel = flat.numel()
        bucket = min(self.bucket, max(numel, 1))  # a bucket larger than the tensor would only pad it
        buckets = -(-numel // bucket)
        padded = torch.zeros(buckets * bucket)
        padded[:numel] = flat
        magnitude = padded.view(buckets, bucket).abs()
        scales = magnitude.amax(dim=1)
        normalized = magnitude / torch.where(scales > 0, scales, 1.0)[:, None] * self.levels
        lower = normalized.floor()
        rounded = lower + (torch.rand(normalized.shape, generator=generator) < normalized - lower)
        levels = (rounded.view(-1)[:numel] * flat.sign()).to(torch.int8)
        if self.bits == 4:
            nibbles = torch.zeros(2 * self._level_bytes(numel), dtype=torch.uint8)
            nibbles[:numel] = (levels + 8).to(torch.uint8)
            pairs = nibbles.view(-1, 2)
            codes = pairs[:, 0] | (pairs[:, 1] << 4)
        else:
            codes = levels.view(torch.uint8)
        payload = torch.cat([_to_bytes(scales), codes])
        return Encoded(self.name, payload, {"bucket": bucket})

    def decode(self, encoded: Encoded, out: torch.Tensor) -> None:
        numel, bucket = out.numel(), encoded.args["bucket"]
        buckets = -(-numel // bucket)
        scales = _from_bytes(encoded.payload[:4 * buckets], torch.float32)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise CodecError(f"encoding {self.name!r}: a scale is negative, NaN or infinite")
        codes = encoded.payload[4 * buckets:]
        if self.bits == 8:
            levels = codes.view(torch.int8)
            if bool((levels == -128).any()):
                raise CodecError(f"encoding {self.name!r}: level -128 is outside [-127, 127]")
        else:
            nibbles = torch.stack([codes & 15, codes >> 4], dim=1).view(-1)
            if bool((nibbles[:numel] == 0).any()) or bool((nibbles[numel:] != 0).any()):
                raise CodecError(f"encoding {self.name!r}: a level nibble is 0 or the pad nibble is not")
            levels = nibbles[:numel].to(torch.int8) - 8
        values = levels.to(torch.float32)
        full = numel // bucket
        step = scales / self.levels
        values[:full * bucket].view(full, bucket).mul_(step[:full, None])
        if full < buckets:
            values[full * bucket:].mul_(step[full])
        out.view(-1).copy_(values)


def _check_indexable(numel: int) -> None:
    if numel > MAX_TOPK_ELEMENTS:
        raise CodecError(f"encoding 'topk' indexes at most {MAX_TOPK_ELEMENTS} elements, the tensor has {numel}")


class TopK:
    """The ``fraction`` (or ``count``) of the elements with the largest magnitudes, as int32
    indices in increasing order followed by their values in the tensor's dtype."""

    name = "topk"
    sparse = True
    lossless = False
    wire_args = ("kept",)

    def __init__(self, fraction: float | None = None, count: int | None = None, error_feedback: bool = True) -> None:
        self.fraction = fraction
        self.count = count
        self.error_feedback = error_feedback

    def payload_nbytes(self, dtype: torch.dtype, numel: int, args: Mapping[str, int]) -> int:
        kept = args["kept"]
        _check_indexable(numel)
        if kept > numel:
            raise CodecError(f"encoding 'topk' keeps {kept} elements of a tensor of {numel}")
        return kept * (4 + dtype.itemsize)

    def kept_of(self, numel: int) -> int:
        """Elements sent of a tensor of ``numel`` (at least one of a non-empty tensor)."""
        wanted = self.count if self.count is not None else math.ceil(self.fraction * numel)
        return min(max(wanted, 1), numel)

    def encode(self, tensor: torch.Tensor, generator: torch.Generator) -> Encoded:
        flat = tensor.detach().reshape(-1)
        _check_indexable(flat.numel())
        kept = self.kept_of(flat.numel())
        indices = flat.abs().topk(kept, sorted=False).indices.sort().values
        payload = torch.cat([_to_bytes(indices.to(torch.int32)), _to_bytes(flat[indices])])
        return Encoded(self.name, payload, {"kept": kept})

    def decode(self, encoded: Encoded, out: torch.Tensor) -> None:
        kept = encoded.args["kept"]
        indices = _from_bytes(encoded.payload[:4 * kept], torch.int32)
        values = _from_bytes(encoded.payload[4 * kept:], out.dtype)
        if kept and (int(indices[0]) < 0 or int(indices[-1]) >= out.numel()
                     or bool((indices[1:] <= indices[:-1]).any())):
            raise CodecError(f"encoding 'topk': indices must increase strictly within [0, {out.numel()})")
        out.zero_()
        out.view(-1)[indices.to(torch.int64)] = values


def _topk_check(options: Mapping[str, Any]) -> str | None:
    if (options["fraction"] is None) == (options["count"] is None):
        return "topk needs exactly one of fraction or count"
    return None


CODECS.register("none", "Tensors travel raw, in their own dtype.")(lambda: None)
CODECS.register("float16", "Cast to IEEE half precision: 2 bytes an element.")(
    lambda: Cast("float16", torch.float16))
CODECS.register("bfloat16", "Cast to bfloat16 (float32's range, 8 bits of mantissa): 2 bytes an element.")(
    lambda: Cast("bfloat16", torch.bfloat16))
_BUCKET = Option("bucket", int, "elements that share one float32 scale", lambda v: v >= 1, "must be at least 1",
                 DEFAULT_BUCKET)
CODECS.register("qsgd8", "Unbiased stochastic quantization to 8-bit levels, one scale per bucket.", _BUCKET)(
    lambda bucket: Qsgd(8, bucket))
CODECS.register("qsgd4", "Unbiased stochastic quantization to 4-bit levels (two a byte), one scale per bucket.",
                _BUCKET)(lambda bucket: Qsgd(4, bucket))
CODECS.register(
    "topk", "The largest-magnitude elements as (index, value) pairs, exactly one of fraction or count; uploads only.",
    Option("fraction", float, "share of the elements sent", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    Option("count", int, "number of elements sent", lambda v: v >= 1, "must be at least 1"),
    Option("error_feedback", bool, "keep what was not sent and add it to the next delta"),
    check=_topk_check)(TopK)


def build_codec(name: str, options: Mapping[str, Any]) -> Codec | None:
    """The codec a (validated) ``compression.up`` / ``compression.down`` section names; None for
    ``none``."""
    return CODECS.build(name, options)


def lossless(codec: Codec | None) -> bool:
    """Whether tensors arrive exactly as sent under ``codec``: raw (None), or a codec that declares
    ``lossless``."""
    return codec is None or getattr(codec, "lossless", False) is True


_DECODERS: dict[str, Codec] = {}


def _decoder_of(encoding: str) -> Codec | None:
    """The decoder of a registered encoding, built with its defaults (options only matter when
    encoding: a payload's spec carries its wire arguments, and :data:`CODECS` refuses a codec with
    an option that has no default); None when unknown. A codec that cannot be built from its
    defaults is a CodecError."""
    if encoding not in _DECODERS:
        if encoding not in CODECS:
            return None
        try:
            codec = CODECS[encoding]()
        except Exception as error:  # a plug-in's builder: whatever it raises, the payload is refused
            raise CodecError(f"encoding {encoding!r}: the decoder cannot be built from the codec's defaults "
                             f"({type(error).__name__}: {error})") from error
        if codec is None:
            return None
        _DECODERS[encoding] = codec
    return _DECODERS[encoding]


def _decoder(encoding: str, dtype: torch.dtype) -> Codec:
    codec = _decoder_of(encoding)
    if codec is None:
        raise CodecError(f"unknown encoding {encoding!r}; known: {sorted(n for n in CODECS if n != 'none')}")
    if dtype not in _FLOATS:
        raise CodecError(f"encoding {encoding!r} applies to floating-point tensors, not {dtype}")
    return codec


def payload_nbytes(encoding: str, dtype: torch.dtype, numel: int, args: Mapping[str, int]) -> int:
    """Exact payload size of a tensor of ``numel`` elements of ``dtype`` under ``encoding`` with
    the spec's ``codec_args``; raises CodecError for arguments that cannot be right."""
    codec = _decoder(encoding, dtype)
    for name, value in sorted(args.items()):
        if name not in codec.wire_args and value:
            raise CodecError(f"{name} {value} does not apply to encoding {encoding!r}")
    return codec.payload_nbytes(dtype, numel, {name: args.get(name, 0) for name in codec.wire_args})


def decode(encoded: Encoded, out: torch.Tensor) -> torch.Tensor:
    """Decode ``encoded`` into ``out`` (contiguous, of the decoded dtype and shape) after checking
    the payload size and every field; returns ``out``. Raises CodecError."""
    expected = payload_nbytes(encoded.encoding, out.dtype, out.numel(), encoded.args)
    if encoded.payload.numel() != expected:
        raise CodecError(f"encoding {encoded.encoding!r}: payload of {encoded.payload.numel()} bytes, "
                         f"expected {expected}")
    complete = {name: encoded.args.get(name, 0) for name in _decoder_of(encoded.encoding).wire_args}
    _decoder_of(encoded.encoding).decode(Encoded(encoded.encoding, encoded.payload, complete), out)
    return out


def encode(codec: Codec | None, tensor: torch.Tensor, generator: torch.Generator) -> Encoded | None:
    """``tensor`` encoded by ``codec``, or None when it travels raw (no codec, or not a float)."""
    if codec is None or tensor.dtype not in _FLOATS:
        return None
    return codec.encode(tensor, generator)


def encode_with_feedback(codec: Codec, delta: torch.Tensor, residual: torch.Tensor | None,
                         generator: torch.Generator) -> tuple[Encoded, torch.Tensor]:
    """Error feedback: encode ``delta + residual`` and return it with the new residual, what the
    payload does not carry, so that decoded payload + new residual == delta + old residual."""
    corrected = delta.detach().to("cpu", copy=True) if residual is None else delta.detach().to("cpu") + residual
    encoded = codec.encode(corrected, generator)
    sent = decode(encoded, torch.empty_like(corrected))
    return encoded, corrected.sub_(sent)


def seeded_generator(*keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded from integer keys (e.g. run seed, round, client): the same
    keys give the same stochastic rounding on every host (the same draws on every device of a kind)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)
