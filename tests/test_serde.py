"""The protobuf edge (``fedpart.common.wire.serde``): plain plans, task and result headers survive the
wire unchanged, and the messages carry exactly the fields the plain values hold."""

from __future__ import annotations

import pytest
import torch

from fedpart.common.wire.plans import EvalPlan, HostedClient, Phase, ResultInfo, TaskInfo, TaskKind, TrainPlan
from fedpart.common.wire.serde import (
    eval_plan,
    eval_plan_message,
    join_info,
    result_header,
    result_info,
    task_header,
    task_info,
    train_plan,
    train_plan_message,
)
from fedpart.common.wire.tensors import WireError, make_spec
from fedpart.proto import fedpart_pb2 as pb

TRAIN = TrainPlan(phases=(Phase(2, ("conv1", "head"), {"unfreeze_fraction": 0.25, "warmup": 3.0}),
                          Phase(1, ("head",))), lr=0.05, batch_size=10, momentum=0.9, weight_decay=1e-3,
                  grad_clip=10.0, upload_deltas=("body.conv1.weight", "head.bias"), upload_values=("head.weight",),
                  seed=2**63 + 5)
EVALUATE = EvalPlan(finetune_epochs=(0, 1, 5), lr=1e-3, momentum=0.9, batch_size=50, part="head", headless=True, seed=7)


def test_plans_survive_the_wire() -> None:
    sent = pb.TrainPlan.FromString(train_plan_message(TRAIN).SerializeToString())
    assert train_plan(sent) == TRAIN
    assert TRAIN.uploads == ("body.conv1.weight", "head.bias", "head.weight")
    assert eval_plan(pb.EvalPlan.FromString(eval_plan_message(EVALUATE).SerializeToString())) == EVALUATE


def test_task_headers_survive_the_wire_with_their_tensor_specs() -> None:
    specs = [make_spec("body.conv1.weight", torch.zeros(3, 2), version=4)]
    for task in (TaskInfo(TaskKind.TRAIN, 12, 3, 7, train=TRAIN, personal_init=("head",)),
                 TaskInfo(TaskKind.EVALUATE, 13, 11, 2, evaluate=EVALUATE)):
        header = pb.TaskHeader.FromString(task_header(task, specs).SerializeToString())
        assert task_info(header) == task
        assert list(header.tensors) == specs
    assert task_info(pb.TaskHeader(kind=pb.DONE)) == TaskInfo(TaskKind.DONE, 0, 0, 0)


def test_a_task_header_of_unknown_kind_is_a_wire_error() -> None:
    with pytest.raises(WireError, match="task 4 has unknown kind 9"):
        task_info(pb.TaskHeader(kind=9, task_id=4))


def test_result_headers_survive_the_wire() -> None:
    result = ResultInfo("s-1", 12, 7, 3, num_samples=40, metrics={"loss": 0.5, "steps": 4.0})
    specs = [make_spec("head.bias", torch.zeros(10))]
    header = pb.ResultHeader.FromString(result_header(result, specs).SerializeToString())
    assert result_info(header) == result
    assert list(header.tensors) == specs


def test_a_join_request_becomes_its_hosted_clients() -> None:
    request = pb.JoinRequest(protocol=1, process_name="host:1", state_run_id="r",
                             clients=[pb.HostedClient(id=3, personal_parts=["head"]), pb.HostedClient(id=4)])
    info = join_info(request)
    assert info.client_ids == [3, 4]
    assert info.clients == (HostedClient(3, frozenset({"head"})), HostedClient(4))
    assert (info.protocol, info.process_name, info.state_run_id) == (1, "host:1", "r")
