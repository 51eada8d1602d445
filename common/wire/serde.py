"""The one place where protobuf messages and the plain values of :mod:`fedpart.common.wire.plans` meet.

The gRPC service (``server/transport/service.py``) and the client runtimes (``client/runtime.py``,
``lab/virtual.py``) convert here, at the edges; the round engine, local training and
evaluation see only the plain values. Tensor specs and pieces stay protobuf and belong to
:mod:`fedpart.common.wire.tensors`, the edge for tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fedpart.common.wire.plans import (
    EvalPlan,
    HostedClient,
    JoinInfo,
    Phase,
    ResultInfo,
    RunOutcome,
    SecAggAnswer,
    SecAggStage,
    SecAggStep,
    TaskInfo,
    TaskKind,
    TrainPlan,
)
from fedpart.common.wire.tensors import WireError
from fedpart.proto import fedpart_pb2 as pb


def train_plan_message(plan: TrainPlan) -> pb.TrainPlan:
    return pb.TrainPlan(
        phases=[pb.Phase(epochs=p.epochs, trainable=list(p.trainable), params=dict(p.params)) for p in plan.phases],
        lr=plan.lr, momentum=plan.momentum, weight_decay=plan.weight_decay, batch_size=plan.batch_size,
        grad_clip=plan.grad_clip, upload_deltas=list(plan.upload_deltas), upload_values=list(plan.upload_values),
        seed=plan.seed,
    )


def train_plan(message: pb.TrainPlan) -> TrainPlan:
    return TrainPlan(
        phases=tuple(Phase(p.epochs, tuple(p.trainable), dict(p.params)) for p in message.phases),
        lr=message.lr, batch_size=message.batch_size, momentum=message.momentum,
        weight_decay=message.weight_decay, grad_clip=message.grad_clip,
        upload_deltas=tuple(message.upload_deltas), upload_values=tuple(message.upload_values), seed=message.seed,
    )


def eval_plan_message(plan: EvalPlan) -> pb.EvalPlan:
    return pb.EvalPlan(finetune_epochs=list(plan.finetune_epochs), finetune_part=plan.part, lr=plan.lr,
                       momentum=plan.momentum, batch_size=plan.batch_size, headless=plan.headless, seed=plan.seed)


def eval_plan(message: pb.EvalPlan) -> EvalPlan:
    return EvalPlan(finetune_epochs=tuple(message.finetune_epochs), lr=message.lr, momentum=message.momentum,
                    batch_size=message.batch_size, part=message.finetune_part, headless=message.headless,
                    seed=message.seed)


def _commitments_message(commitments: Mapping[int, tuple[bytes, bytes]]) -> dict[int, pb.ShareCommitments]:
    return {c: pb.ShareCommitments(seed_share=pair[0], key_share=pair[1]) for c, pair in commitments.items()}


def _commitments(message: Mapping[int, pb.ShareCommitments]) -> dict[int, tuple[bytes, bytes]]:
    return {c: (pair.seed_share, pair.key_share) for c, pair in message.items()}


def secagg_step_message(step: SecAggStep) -> pb.SecAggStep:
    return pb.SecAggStep(
        stage=int(step.stage), threshold=step.threshold, sealed=dict(step.sealed),
        peers=[pb.SecAggPeer(client_id=c, cipher_key=keys[0], mask_key=keys[1]) for c, keys in step.peers.items()],
        survivors=list(step.survivors), dropped=list(step.dropped), bound=step.bound, step=step.step,
        weight=step.weight, commitments=_commitments_message(step.commitments), mask_with=list(step.mask_with))


def secagg_step(message: pb.SecAggStep) -> SecAggStep:
    """The step a header asks for; raises WireError for an unknown stage or a peer listed twice."""
    try:
        stage = SecAggStage(message.stage)
    except ValueError as error:
        raise WireError(f"unknown secure aggregation stage {message.stage}") from error
    peers = {p.client_id: (p.cipher_key, p.mask_key) for p in message.peers}
    if len(peers) != len(message.peers):
        raise WireError("a secure aggregation step lists a peer twice")
    return SecAggStep(stage=stage, peers=peers, threshold=message.threshold, sealed=dict(message.sealed),
                      survivors=tuple(message.survivors), dropped=tuple(message.dropped), bound=message.bound,
                      step=message.step, weight=message.weight, commitments=_commitments(message.commitments),
                      mask_with=tuple(message.mask_with))


def secagg_answer_message(answer: SecAggAnswer) -> pb.SecAggAnswer:
    return pb.SecAggAnswer(cipher_key=answer.cipher_key, mask_key=answer.mask_key, sealed=dict(answer.sealed),
                           revealed=dict(answer.revealed), seed_commitment=answer.seed_commitment,
                           commitments=_commitments_message(answer.commitments), disputed=list(answer.disputed))


def secagg_answer(message: pb.SecAggAnswer) -> SecAggAnswer:
    return SecAggAnswer(cipher_key=message.cipher_key, mask_key=message.mask_key, sealed=dict(message.sealed),
                        revealed=dict(message.revealed), seed_commitment=message.seed_commitment,
                        commitments=_commitments(message.commitments), disputed=tuple(message.disputed))


def task_header(task: TaskInfo, tensors: Iterable[pb.TensorSpec]) -> pb.TaskHeader:
    """The header of a task stream: the task and the specs of the global tensors that follow."""
    header = pb.TaskHeader(kind=int(task.kind), task_id=task.task_id, round=task.round, client_id=task.client_id,
                           tensors=tensors, personal_init=list(task.personal_init), outcome=int(task.outcome),
                           result_chunk_bytes=task.result_chunk_bytes)
    if task.train is not None:
        header.train.CopyFrom(train_plan_message(task.train))
    if task.evaluate is not None:
        header.evaluate.CopyFrom(eval_plan_message(task.evaluate))
    if task.secagg is not None:
        header.secagg.CopyFrom(secagg_step_message(task.secagg))
    return header


def task_info(header: pb.TaskHeader) -> TaskInfo:
    """The task a header describes; raises WireError for a kind this protocol does not know."""
    try:
        kind = TaskKind(header.kind)
    except ValueError as error:
        raise WireError(f"task {header.task_id} has unknown kind {header.kind}") from error
    try:
        outcome = RunOutcome(header.outcome)
    except ValueError as error:
        raise WireError(f"task {header.task_id} has unknown run outcome {header.outcome}") from error
    return TaskInfo(kind=kind, task_id=header.task_id, round=header.round, client_id=header.client_id,
                    train=train_plan(header.train) if header.HasField("train") else None,
                    evaluate=eval_plan(header.evaluate) if header.HasField("evaluate") else None,
                    personal_init=tuple(header.personal_init), outcome=outcome,
                    result_chunk_bytes=header.result_chunk_bytes,
                    secagg=secagg_step(header.secagg) if header.HasField("secagg") else None)


def result_header(result: ResultInfo, tensors: Iterable[pb.TensorSpec] = ()) -> pb.ResultHeader:
    """The header of a result stream: the result and the specs of the tensors that follow."""
    header = pb.ResultHeader(session=result.session, task_id=result.task_id, client_id=result.client_id,
                             round=result.round, num_samples=result.num_samples, metrics=dict(result.metrics),
                             tensors=tensors)
    if result.secagg is not None:
        header.secagg.CopyFrom(secagg_answer_message(result.secagg))
    return header


def result_info(header: pb.ResultHeader) -> ResultInfo:
    return ResultInfo(session=header.session, task_id=header.task_id, client_id=header.client_id,
                      round=header.round, num_samples=header.num_samples, metrics=dict(header.metrics),
                      secagg=secagg_answer(header.secagg) if header.HasField("secagg") else None)


def join_info(request: pb.JoinRequest) -> JoinInfo:
    return JoinInfo(protocol=request.protocol, process_name=request.process_name,
                    clients=tuple(HostedClient(c.id, frozenset(c.personal_parts)) for c in request.clients),
                    state_run_id=request.state_run_id)
