"""gRPC service: translates the wire protocol into :class:`Coordinator` calls and counts the
serialized size of every message it sends or receives.

Every call is admitted by :class:`~fedpart.server.auth.CallGuard` (caller, bounded deadline,
per-caller concurrency) before it does anything. A result stream is read against what its task
asked for: the header must declare exactly the expected tensors (names, dtypes, shapes) before
any piece is read, every later chunk must carry tensor bytes and nothing else, and a tensor's
buffer is allocated when its first byte arrives, so memory is bounded by the task, never by a
declared size. Bytes of a refused result are counted as refused, not as traffic of the round.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from fedpart.common.split_model import tensor_part
from fedpart.common.wire import TensorAssembler, WireError, encode_chunks, measure_chunk
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.accounting import PROCESS
from fedpart.server.auth import CallGuard
from fedpart.server.coordinator import Coordinator, Denied, Rejected, Task

# Longest deadline a unary call may ask for (join, heartbeat, leave answer at once).
UNARY_CALL_SECONDS = 120.0


def _control(size: int) -> dict[str, int]:
    return {"control": size}


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The five RPCs of ``proto/fedpart.proto``."""

    def __init__(self, coordinator: Coordinator, guard: CallGuard) -> None:
        self.coordinator = coordinator
        self.guard = guard
        self.stream_seconds = coordinator.config.server.call_timeout

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        with self.guard.admit(context, UNARY_CALL_SECONDS) as principal:
            try:
                reply = self.coordinator.join(request, principal)
            except Denied as error:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
            except Rejected as error:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
            self.coordinator.account(None, PROCESS, "up", _control(request.ByteSize()))
            self.coordinator.account(None, PROCESS, "down", _control(reply.ByteSize()))
            return reply

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        with self.guard.admit(context, UNARY_CALL_SECONDS) as principal:
            reply = pb.HeartbeatReply(known=self.coordinator.heartbeat(request.session, principal))
            self.coordinator.account(None, PROCESS, "up", _control(request.ByteSize()))
            self.coordinator.account(None, PROCESS, "down", _control(reply.ByteSize()))
            return reply

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        with self.guard.admit(context, UNARY_CALL_SECONDS) as principal:
            self.coordinator.leave(request.session, request.reason, principal)
            reply = pb.LeaveReply()
            self.coordinator.account(None, PROCESS, "up", _control(request.ByteSize()))
            self.coordinator.account(None, PROCESS, "down", _control(reply.ByteSize()))
            return reply

    def GetTask(self, request: pb.TaskRequest, context: grpc.ServicerContext) -> Iterator[pb.TaskChunk]:
        with self.guard.admit(context, self.stream_seconds) as principal:
            try:
                task = self.coordinator.next_task(request.session, request.wait_seconds, principal)
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
            self.coordinator.account(task.round, task.client_id, "down", _chunk_parts(chunk, parts))
            yield chunk

    def SubmitResult(self, request_iterator: Iterator[pb.ResultChunk], context: grpc.ServicerContext) -> pb.SubmitReply:
        with self.guard.admit(context, self.stream_seconds) as principal:
            first = next(request_iterator, None)
            if first is None or not first.HasField("header"):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a result stream must start with a header")
            header = first.header
            try:
                task = self.coordinator.result_task(header, principal)
            except Rejected as error:
                self.coordinator.ledger.refuse(first.ByteSize())
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
            # A call that ends before its result is taken (cancelled, or broken by gRPC itself, e.g.
            # an oversized message) drops the task at once; after acceptance this does nothing.
            context.add_callback(lambda: self.coordinator.fail_task(task, "the result stream ended early"))
            received = Received(task)
            parts = [tensor_part(spec.name) for spec in header.tensors]
            received.add(_chunk_parts(first, parts), "up")
            reply = pb.SubmitReply(accepted=True)
            try:
                self.coordinator.check_declared(task, header)
                tensors = self._receive(received, first, request_iterator, parts)
                received.add(_control(reply.ByteSize()), "down")
                self.coordinator.accept(task, header, tensors, commit=lambda: received.commit(self.coordinator))
            except (Rejected, WireError) as error:
                self.coordinator.ledger.refuse(received.total())
                self.coordinator.fail_task(task, f"result rejected: {error}")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"result rejected: {error}")
            except grpc.RpcError:
                self.coordinator.ledger.refuse(received.total())
                self.coordinator.fail_task(task, "the result stream broke off")
                raise
            return reply

    def _receive(self, received: Received, first: pb.ResultChunk, rest: Iterator[pb.ResultChunk],
                 parts: list[str]) -> dict:
        """Read the pieces of a result whose header was checked against its task."""
        assembler = TensorAssembler(first.header.tensors)
        assembler.add(first.pieces)
        for chunk in rest:
            size = measure_chunk(chunk)
            received.add(_chunk_parts(chunk, parts, size), "up")
            if chunk.HasField("header"):
                raise WireError("a second header inside one result stream")
            if size.control or not chunk.pieces:
                raise WireError("a result chunk after the header must carry tensor bytes and nothing else")
            assembler.add(chunk.pieces)
        return assembler.tensors()


class Received:
    """Bytes of one result stream (and its reply), held until the result is accepted: they enter
    the ledger together with the result, so a round's record never misses them."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.by_direction: dict[str, dict[str, int]] = {"up": {}, "down": {}}

    def add(self, by_part: dict[str, int], direction: str) -> None:
        counts = self.by_direction[direction]
        for part, count in by_part.items():
            counts[part] = counts.get(part, 0) + count

    def total(self) -> int:
        return sum(self.by_direction["up"].values())

    def commit(self, coordinator: Coordinator) -> None:
        for direction, by_part in self.by_direction.items():
            coordinator.account(self.task.round, self.task.client_id, direction, by_part)


def _chunk_parts(chunk, parts: list[str], size=None) -> dict[str, int]:
    """Serialized bytes of ``chunk`` by part (tensor bytes by their tensor's part, the rest control)."""
    size = size or measure_chunk(chunk)
    by_part = {"control": size.control}
    for index, count in size.by_tensor.items():
        part = parts[index] if index < len(parts) else "control"
        by_part[part] = by_part.get(part, 0) + count
    return by_part
