"""gRPC service: translates the wire protocol into :class:`Coordinator` calls and counts the
serialized size of every message it sends or receives."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from fedpart.common.wire import TensorAssembler, WireError, encode_chunks, measure_chunk
from fedpart.common.split_model import tensor_part
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.accounting import PROCESS
from fedpart.server.coordinator import Coordinator, Rejected, Task


def _control(size: int) -> dict[str, int]:
    return {"control": size}


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The four RPCs of ``proto/fedpart.proto``."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            reply = self.coordinator.join(request)
        except Rejected as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        self.coordinator.account(None, PROCESS, "up", _control(request.ByteSize()))
        self.coordinator.account(None, PROCESS, "down", _control(reply.ByteSize()))
        return reply

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        reply = pb.HeartbeatReply(known=self.coordinator.heartbeat(request.session))
        self.coordinator.account(None, PROCESS, "up", _control(request.ByteSize()))
        self.coordinator.account(None, PROCESS, "down", _control(reply.ByteSize()))
        return reply

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self.coordinator.leave(request.session, request.reason)
        reply = pb.LeaveReply()
        self.coordinator.account(None, PROCESS, "up", _control(request.ByteSize()))
        self.coordinator.account(None, PROCESS, "down", _control(reply.ByteSize()))
        return reply

    def GetTask(self, request: pb.TaskRequest, context: grpc.ServicerContext) -> Iterator[pb.TaskChunk]:
        try:
            task = self.coordinator.next_task(request.session, request.wait_seconds)
        except Rejected as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        if task is None or task.kind == pb.DONE:
            chunk = pb.TaskChunk(header=pb.TaskHeader(kind=pb.DONE if task else pb.IDLE))
            self.coordinator.account(None, PROCESS, "up", _control(request.ByteSize()))
            self.coordinator.account(None, PROCESS, "down", _control(chunk.ByteSize()))
            yield chunk
            return
        self.coordinator.account(task.round, task.client_id, "up", _control(request.ByteSize()))
        try:
            yield from self._send_task(task, request)
        except GeneratorExit:
            self.coordinator.fail_task(task, "the client went away while the task was being sent")
            raise
        except Exception as error:  # noqa: BLE001 - any failure while sending drops only this task
            self.coordinator.fail_task(task, f"sending the task failed: {error}")
            raise

    def _send_task(self, task: Task, request: pb.TaskRequest) -> Iterator[pb.TaskChunk]:
        specs, tensors = self.coordinator.task_tensors(task, request.held_versions)
        header = pb.TaskHeader(kind=task.kind, task_id=task.task_id, round=task.round, client_id=task.client_id,
                               tensors=specs, personal_init=list(task.personal_init))
        if task.train is not None:
            header.train.CopyFrom(task.train)
        if task.evaluate is not None:
            header.evaluate.CopyFrom(task.evaluate)
        parts = [tensor_part(spec.name) for spec in specs]
        for chunk in encode_chunks(pb.TaskChunk, header, tensors, self.coordinator.config.server.chunk_bytes):
            self._account_chunk(task, "down", chunk, parts)
            yield chunk

    def _account_chunk(self, task: Task, direction: str, chunk, parts: list[str]) -> None:
        size = measure_chunk(chunk)
        by_part = {"control": size.control}
        for index, count in size.by_tensor.items():
            part = parts[index] if index < len(parts) else "control"
            by_part[part] = by_part.get(part, 0) + count
        self.coordinator.account(task.round, task.client_id, direction, by_part)

    def SubmitResult(self, request_iterator: Iterator[pb.ResultChunk], context: grpc.ServicerContext) -> pb.SubmitReply:
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a result stream must start with a header")
        header = first.header
        try:
            task = self.coordinator.expected_uploads(header.task_id, header.session, header)
        except Rejected as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        try:
            tensors = self._receive(task, first, request_iterator)
            self.coordinator.accept(task, header, tensors)
        except (Rejected, WireError) as error:
            self.coordinator.fail_task(task, f"result rejected: {error}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"result rejected: {error}")
        reply = pb.SubmitReply(accepted=True)
        self.coordinator.account(task.round, task.client_id, "down", _control(reply.ByteSize()))
        return reply

    def _receive(self, task: Task, first: pb.ResultChunk, rest: Iterator[pb.ResultChunk]):
        """Read the pieces of a result, refusing undeclared or oversized tensors before any data."""
        header = first.header
        allowed = set()
        if task.train is not None:
            allowed = set(task.train.upload_deltas) | set(task.train.upload_values)
        declared = [spec.name for spec in header.tensors]
        unexpected = sorted(set(declared) - allowed)
        if unexpected:
            raise Rejected(f"result declares tensors {unexpected} the task did not ask for")
        assembler = TensorAssembler(header.tensors, self.coordinator.config.server.max_message_bytes)
        parts = [tensor_part(name) for name in declared]
        self._account_chunk(task, "up", first, parts)
        assembler.add(first.pieces)
        for chunk in rest:
            if chunk.HasField("header"):
                raise WireError("a second header inside one result stream")
            self._account_chunk(task, "up", chunk, parts)
            assembler.add(chunk.pieces)
        return assembler.tensors()
