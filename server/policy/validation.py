"""What a client may send: every rule a result must follow, in one place.

A result is checked in three stages, each before the work it guards (docs/architecture.md, Trust: a result
is never trusted for more than its shape):

1. its header, before any tensor byte is read (:func:`check_header`): it declares exactly the
   tensors its task asked for, with their dtypes and shapes, and a bounded set of metrics, so a
   result costs at most what its task asked for;
2. its stream, as it is read (:func:`check_first_chunk`, :func:`check_later_chunk`): the header
   comes first and only once, and every later chunk carries tensor bytes and nothing else (the
   bytes per tensor are bounded by the decoder, ``wire.TensorAssembler`` and the codecs);
3. the complete result, before it is folded (:func:`check_result`): finite metrics; for
   training, finite tensors and at least one sample when it uploads anything; for an evaluation,
   a report that fits its plan (:func:`check_evaluation`).

What a valid result may still weigh (sample caps, norm bounds) is the server policy's
(``server/policy.py``). A broken rule raises :class:`~fedpart.common.wire.protocol.InvalidResult`.
Strings from clients are made safe for one log line (:func:`printable`) before they are logged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from fedpart.common.wire.plans import EvalPlan, ResultInfo, TaskInfo, TaskKind
from fedpart.common.wire.protocol import InvalidResult
from fedpart.common.wire.tensors import ReceivedChunk
from fedpart.proto import fedpart_pb2 as pb

# Bounds on what a result header may carry besides its tensor specs.
MAX_METRICS = 64
MAX_METRIC_NAME = 64
SAMPLE_COUNTS = ("train_samples", "test_samples")  # the sample counts an evaluation report carries


def reported(key: str) -> str:
    """The key under which the server keeps what a client reported for a sample count it capped
    (``server/policy.py``); a client may not send it."""
    return f"reported_{key}"


def check_header(result: ResultInfo, declared: Sequence[pb.TensorSpec], expected: Sequence[pb.TensorSpec]) -> None:
    """Before any tensor byte is read: the header declares exactly the ``expected`` tensors
    (names, dtypes, shapes: those its task uploads) and bounded metrics."""
    if len(result.metrics) > MAX_METRICS or any(len(k) > MAX_METRIC_NAME for k in result.metrics):
        raise InvalidResult(f"a result carries at most {MAX_METRICS} metrics with names of at most "
                            f"{MAX_METRIC_NAME} characters")
    by_name = {spec.name: spec for spec in declared}
    if len(by_name) != len(declared) or set(by_name) != {s.name for s in expected}:
        raise InvalidResult(f"uploaded tensors {sorted(printable(n) for n in by_name)} differ from the "
                            f"expected {sorted(s.name for s in expected)}")
    for spec in expected:
        got = by_name[spec.name]
        if got.dtype != spec.dtype or list(got.shape) != list(spec.shape):
            raise InvalidResult(f"tensor {spec.name!r}: got {_torch_dtype_name(got.dtype)} {list(got.shape)}, "
                                f"expected {_torch_dtype_name(spec.dtype)} {list(spec.shape)}")


def check_first_chunk(chunk: ReceivedChunk | None) -> pb.ResultHeader:
    """A result stream starts with its header; returns it."""
    if chunk is not None and chunk.malformed:
        raise InvalidResult(chunk.malformed)
    if chunk is None or chunk.header is None:
        raise InvalidResult("a result stream must start with a header")
    return chunk.header


def check_later_chunk(chunk: ReceivedChunk, largest: int) -> None:
    """A chunk after the header carries tensor bytes and nothing else, in a message of at most
    ``largest`` bytes (what its task asked for)."""
    if chunk.malformed:
        raise InvalidResult(chunk.malformed)
    if chunk.header is not None:
        raise InvalidResult("a second header inside one result stream")
    if chunk.size.control or not chunk.pieces:
        raise InvalidResult("a result chunk after the header must carry tensor bytes and nothing else")
    if chunk.size.total > largest:
        raise InvalidResult(f"a result chunk of {chunk.size.total} bytes, more than the {largest} its task asked for")


def check_result(task: TaskInfo, result: ResultInfo, tensors: Mapping[str, torch.Tensor],
                 trained_samples: int | None) -> None:
    """A complete result, before it is folded: finite metrics; a training result's tensors (whose
    names, dtypes and shapes passed :func:`check_header`) finite, and at least one sample when it
    uploads; an evaluation report as :func:`check_evaluation` wants it."""
    bad_metrics = [printable(k) for k, v in result.metrics.items() if not math.isfinite(v)]
    if bad_metrics:
        raise InvalidResult(f"non-finite metrics {bad_metrics}")
    if task.kind == TaskKind.EVALUATE:
        check_evaluation(result.metrics, task.evaluate, trained_samples)
        return
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not all_finite(tensor):
            raise InvalidResult(f"tensor {name!r} holds NaN or infinite values")
    if result.num_samples == 0 and task.uploads():
        raise InvalidResult("a result with uploads must report at least one training sample")


def check_evaluation(metrics: Mapping[str, float], plan: EvalPlan, trained_samples: int | None) -> None:
    """An evaluation report must carry the keys its plan implies, accuracies in [0, 1], whole
    non-negative sample counts, and the training sample count the client reported in training;
    it may not carry the keys the server sets (:func:`reported`)."""
    missing = [k for k in SAMPLE_COUNTS if k not in metrics]
    if missing:
        raise InvalidResult(f"evaluation result lacks {missing}")
    reserved = [reported(k) for k in SAMPLE_COUNTS if reported(k) in metrics]
    if reserved:
        raise InvalidResult(f"evaluation result carries {reserved}, which only the server sets")
    for key in SAMPLE_COUNTS:
        value = metrics[key]
        if value < 0 or value != int(value):
            raise InvalidResult(f"evaluation result: {key} = {value} is not a whole number of samples")
    if trained_samples is not None and metrics["train_samples"] != trained_samples:
        raise InvalidResult(f"evaluation result: train_samples = {metrics['train_samples']:.0f}, but the client "
                            f"trained on {trained_samples}")
    if metrics["test_samples"] > 0:
        wanted = ["initial_loss"] + [f"finetune_{e}_loss" for e in plan.finetune_epochs]
        absent = [k for k in wanted if k not in metrics]
        if absent:
            raise InvalidResult(f"evaluation result lacks {absent}")
    for key, value in metrics.items():
        if key.endswith("_acc") and not 0.0 <= value <= 1.0:
            raise InvalidResult(f"evaluation result: {printable(key)} = {value} is not an accuracy in [0, 1]")


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in ``tensor``.

    A sum in the tensor's own dtype is finite only if every element is (a NaN or infinity never
    leaves a sum), so a finite sum settles it, without the cost of a float64 sum. Only a non-finite sum, which finite elements may also reach by overflowing, is
    checked again: for 32-bit and narrower floats by a float64 sum, which cannot overflow and so is
    non-finite exactly when an element is, and for float64 element by element."""
    if math.isfinite(torch.sum(tensor).item()):
        return True
    if tensor.dtype == torch.float64:
        return bool(torch.isfinite(tensor).all())
    return bool(torch.sum(tensor, dtype=torch.float64).isfinite())


def printable(text: str, limit: int = 200) -> str:
    """A client-supplied string made safe for one log line: control characters (newlines
    included) escaped, length capped."""
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return escaped + ("..." if len(text) > limit else "")


def _torch_dtype_name(wire_name: str) -> str:
    return f"torch.{printable(wire_name, 20)}"
