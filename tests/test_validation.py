"""The rules a result must follow (``fedpart.server.policy.validation``), one by one; the gRPC tests
(test_protocol.py, test_security.py) check that the service applies them to real streams."""

from __future__ import annotations

import pytest
import torch

from fedpart.common.wire.plans import EvalPlan, Phase, ResultInfo, TaskInfo, TaskKind, TrainPlan
from fedpart.common.wire.protocol import RESULT_REJECTED, InvalidResult
from fedpart.common.wire.tensors import ReceivedChunk, encode_chunks, make_spec, read_chunk
from fedpart.proto import fedpart_pb2 as pb
from fedpart.server.policy.validation import (
    MAX_METRICS,
    all_finite,
    check_evaluation,
    check_first_chunk,
    check_header,
    check_later_chunk,
    check_result,
    printable,
)

WEIGHT = torch.zeros(3, 2)
PLAN = TrainPlan(phases=(Phase(1, ("fc", "head")),), lr=0.1, batch_size=10, upload_deltas=("fc.weight",))
TRAIN = TaskInfo(TaskKind.TRAIN, 5, 1, 2, train=PLAN)
EVALUATE = TaskInfo(TaskKind.EVALUATE, 6, 4, 2, evaluate=EvalPlan((1,), lr=1e-3, momentum=0.9, batch_size=50))
EVALUATION = {"train_samples": 10.0, "test_samples": 5.0, "initial_loss": 0.1, "initial_acc": 0.5,
              "finetune_1_loss": 0.1}


def result(**changes) -> ResultInfo:
    fields = {"session": "s", "task_id": 5, "client_id": 2, "round": 1, "num_samples": 10, "metrics": {"loss": 1.0}}
    return ResultInfo(**{**fields, **changes})


def test_a_refused_result_is_sent_back_as_result_rejected() -> None:
    assert InvalidResult.code == RESULT_REJECTED


def test_the_header_declares_exactly_the_expected_tensors() -> None:
    expected = [make_spec("fc.weight", WEIGHT)]
    check_header(result(), expected, expected)
    for declared, message in [
        ([], "differ from the expected"),
        ([*expected, make_spec("head.bias", torch.zeros(2))], "differ from the expected"),
        ([*expected, *expected], "differ from the expected"),
        ([make_spec("fc.weight", torch.zeros(3, 3))], "expected torch.float32 [3, 2]"),
        ([make_spec("fc.weight", WEIGHT.double())], "got torch.float64 [3, 2]"),
    ]:
        with pytest.raises(InvalidResult, match=message.replace("[", r"\[")):
            check_header(result(), declared, expected)


def test_the_header_carries_bounded_metrics() -> None:
    with pytest.raises(InvalidResult, match=f"at most {MAX_METRICS} metrics"):
        check_header(result(metrics={f"m{i}": 0.0 for i in range(MAX_METRICS + 1)}), [], [])
    with pytest.raises(InvalidResult, match="at most"):
        check_header(result(metrics={"x" * 65: 0.0}), [], [])


def received(message: pb.ResultChunk | bytes) -> ReceivedChunk:
    """A chunk as the server reads it off the wire."""
    return read_chunk(pb.ResultHeader, message if isinstance(message, bytes) else message.SerializeToString())


def test_the_stream_starts_with_one_header_and_then_carries_tensor_bytes_only() -> None:
    header = pb.ResultHeader(task_id=5, tensors=[make_spec("fc.weight", WEIGHT)])
    first, second = map(received, encode_chunks(pb.ResultChunk, header, [torch.zeros(64)], chunk_bytes=200))
    assert check_first_chunk(first) == header
    check_later_chunk(second, 200)
    for chunk in (None, second):
        with pytest.raises(InvalidResult, match="must start with a header"):
            check_first_chunk(chunk)
    with pytest.raises(InvalidResult, match="a second header"):
        check_later_chunk(first, 200)
    serialized = encode_chunks(pb.ResultChunk, None, [torch.zeros(64)], chunk_bytes=200)
    smuggled = received(next(serialized).SerializeToString() + b"\x1a\x03abc")  # an unknown field 3
    for chunk in (received(b""), smuggled):
        with pytest.raises(InvalidResult, match="tensor bytes and nothing else"):
            check_later_chunk(chunk, 200)
    for garbage in (b"\x12\xff", b"\x0a\x02\xff\xff", b"\x13"):  # cut short, a bad header, a group
        with pytest.raises(InvalidResult, match="not a chunk message"):
            check_first_chunk(received(garbage))
        with pytest.raises(InvalidResult, match="not a chunk message"):
            check_later_chunk(received(garbage), 200)
    check_later_chunk(second, second.size.total)
    with pytest.raises(InvalidResult, match=f"a result chunk of {second.size.total} bytes, more than the 60 its task"):
        check_later_chunk(second, 60)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_elements_whose_sum_overflows_are_finite_and_one_bad_element_is_not(dtype: torch.dtype) -> None:
    largest = torch.finfo(dtype).max
    overflowing = torch.full((1000,), largest, dtype=dtype)
    assert torch.isinf(overflowing.sum())  # the sum in the tensor's own dtype is not the answer
    assert all_finite(overflowing)
    assert all_finite(torch.zeros(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for tensor in (torch.ones(1000, dtype=dtype), overflowing.clone()):
            tensor[537] = bad
            assert not all_finite(tensor), (dtype, bad)
    cancelling = torch.tensor([float("inf"), -float("inf")], dtype=dtype)
    assert not all_finite(cancelling)


def test_an_evaluation_report_fits_its_plan_and_the_training_it_follows() -> None:
    check_result(EVALUATE, result(task_id=6, round=4, num_samples=0, metrics=EVALUATION), {}, 10)
    with pytest.raises(InvalidResult, match="trained on 9"):
        check_result(EVALUATE, result(task_id=6, round=4, metrics=EVALUATION), {}, 9)
    with pytest.raises(InvalidResult, match=r"lacks \['finetune_1_loss'\]"):
        check_evaluation({k: v for k, v in EVALUATION.items() if k != "finetune_1_loss"}, EVALUATE.evaluate, None)
    with pytest.raises(InvalidResult, match="not an accuracy"):
        check_evaluation({**EVALUATION, "initial_acc": 1.5}, EVALUATE.evaluate, None)


def test_client_strings_become_one_bounded_log_line() -> None:
    assert printable("a\nb\r") == "a\\nb\\r"
    assert printable("x" * 300) == "x" * 200 + "..."
