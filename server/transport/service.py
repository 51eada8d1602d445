"""gRPC service (asyncio): the transport. It translates the wire protocol into calls of the
process registry, the task board and the round engine (``server/engine/registry.py``,
``server/engine/task_board.py``, ``server/engine/coordinator.py``), converting messages at this edge
(:mod:`fedpart.common.wire.serde`), and records the serialized size of every message it sends or
receives in the run's :class:`~fedpart.server.output.accounting.ByteLedger`, and beside them each task's
logical bytes: a task's when it is first sent, a result's when it is accepted.

Every handler runs on one event loop, so a waiting client costs a coroutine, not a thread: a long
poll registers a waiter on the task board and sleeps until its own process has work. A result is
validated and folded on the event loop itself (or on ``server.fold_workers`` threads): each torch
op of the validation and each block of a fold releases the GIL, and a fold thread then waits to
take it back from the busy loop, a context switch each time; inline, a round's results cost the
server less CPU than on a fold thread (``benchmarks/server_scale.py --set server.fold_workers=1``
compares them; docs/benchmarks.md, "Server at scale").

Every call is admitted by :class:`~fedpart.server.transport.auth.CallGuard` (caller, bounded deadline,
per-caller concurrency) before it does anything. A result stream is read against what its task
asked for, by the rules of :mod:`fedpart.server.policy.validation`: the header is checked before any
piece is read, every later chunk as it arrives, and pieces are copied into the staging tensors of
an upload slot (:mod:`fedpart.server.transport.transfers`), so memory is bounded by the slots, never by a
declared size or the number of uploads. Bytes of a refused result are counted as refused, not as
traffic of the round.

A stream that ends early, a task's or a result's, is a transport failure, not a bad result: the
task stays with its process, which asks for it again or sends its result again; a copy of a
result the server took already is answered ``duplicate`` and dropped (at-least-once delivery,
:mod:`fedpart.server.engine.task_board`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from functools import partial

import grpc

from fedpart.common.wire.codecs import build_codec
from fedpart.common.wire.plans import TaskKind
from fedpart.common.wire.protocol import NOT_YET_KEY, RESULT_REJECTED, SERVICE_NAME, InvalidResult, NotYet, Rejected
from fedpart.common.wire.serde import join_info, result_info, task_header
from fedpart.common.ml.split_model import tensor_part
from fedpart.common.wire.tensors import IncompleteMessage, ReceivedChunk, TensorAssembler, WireError, read_chunk
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.output.accounting import PROCESS, ByteLedger
from fedpart.server.transport.auth import CallGuard
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.engine.task_board import DuplicateResult, Task
from fedpart.server.transport.transfers import (LogicalTensors, TaskPayloads, UploadSlots, bytes_by_part,
                                                logical_header_bytes, result_chunk_bytes)
from fedpart.server.policy.validation import check_first_chunk, check_header, check_later_chunk

# Longest deadline a unary call may ask for (join, heartbeat, leave answer at once).
UNARY_CALL_SECONDS = 120.0
# Longest a single long poll waits for work before answering IDLE.
MAX_POLL_SECONDS = 60.0
# Longest the server holds a heartbeat that asks to be held (client/session.py holds one for
# its heartbeat interval, at most 5 s).
MAX_HOLD_SECONDS = 30.0
# The answer to a copy of a result the server took already (at-least-once delivery).
DUPLICATE = pb.SubmitReply(accepted=True, duplicate=True)


def _control(size: int) -> dict[str, int]:
    return {"control": size}


def _secagg_bytes(task: Task, message_size: int, header: pb.TaskHeader | pb.ResultHeader | None = None) -> int:
    """Bytes of a message of ``task`` that secure aggregation costs (the ledger's part ``secagg``):
    all of a SECAGG task's messages, and of a training task's the step in its header or the
    answer in its result's header (``header``), as encoded there."""
    if task.kind == TaskKind.SECAGG:
        return message_size
    if header is None or not header.HasField("secagg"):
        return 0
    size = header.secagg.ByteSize()
    return 1 + max(1, (size.bit_length() + 6) // 7) + size  # field tag, length varint, the message


def _with_secagg(by_part: dict[str, int], secagg: int) -> dict[str, int]:
    """``by_part`` with ``secagg`` of its control bytes counted under the part ``secagg``."""
    if not secagg:
        return by_part
    return {**by_part, "control": by_part.get("control", 0) - secagg, "secagg": secagg}


class LoopWaiter:
    """A long poll waiting on the event loop; :meth:`wake` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.superseded = False
        self.loop = loop
        self.event = asyncio.Event()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The five RPCs of ``proto/fedpart.proto``. Create it inside the server's event loop."""

    def __init__(self, coordinator: Coordinator, ledger: ByteLedger, guard: CallGuard, fold_pool: Executor | None,
                 upload_slots: int, download_slots: int) -> None:
        self.coordinator = coordinator
        self.client_config_json = coordinator.config.for_clients().to_json()  # what a Join is sent
        self.registry = coordinator.registry
        self.board = coordinator.board
        self.ledger = ledger
        self.guard = guard
        self.fold_pool = fold_pool
        self.uploads = UploadSlots(upload_slots)
        self.run_over = asyncio.Event()  # set when the run ends: held heartbeats answer at once
        self.downloads = asyncio.Semaphore(download_slots)
        down = coordinator.config.compression.down
        self.payloads = TaskPayloads(coordinator.config.server.chunk_bytes, codec=build_codec(down.codec, down.options),
                                     seed=coordinator.config.training_seed)
        self.stream_seconds = coordinator.config.server.call_timeout
        server = coordinator.config.server
        # the message size a training task names to a process connected alone (logical bytes)
        self.logical_result_chunk_bytes = result_chunk_bytes(server.result_chunk_bytes, server.waiting_upload_bytes, 1)

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        async with self.guard.admit(context, UNARY_CALL_SECONDS) as principal:
            try:
                session = self.coordinator.join(join_info(request), principal, context.peer())
            except Rejected as error:
                if isinstance(error, NotYet):
                    context.set_trailing_metadata(((NOT_YET_KEY, "1"),))
                await context.abort(error.code, str(error))
            reply = pb.JoinReply(session=session, run_config_json=self.client_config_json,
                                 run_id=self.coordinator.run_id)
            self._count_process_call(request, reply)
            return reply

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        async with self.guard.admit(context, UNARY_CALL_SECONDS) as principal:
            known = self.registry.heartbeat(request.session, principal)
            if known and request.hold_seconds > 0:
                await self._hold(request.session, principal, min(request.hold_seconds, MAX_HOLD_SECONDS))
            reply = pb.HeartbeatReply(known=known)
            self._count_process_call(request, reply)
            return reply

    async def _hold(self, session: str, principal, seconds: float) -> None:
        """Keep a heartbeat open for ``seconds`` or until the run is over: while it is, its process
        counts as connected; cancelled by its connection closing, it frees the process's
        credential for the process that replaces it (``server/engine/registry.py``)."""
        process = self.registry.hold(session, principal)
        if process is None:
            return
        cancelled = False
        over = asyncio.ensure_future(self.run_over.wait())
        try:  # asyncio.wait, not wait_for: Python 3.11's wait_for may swallow a cancellation
            await asyncio.wait((over,), timeout=seconds)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            over.cancel()
            self.registry.unhold(process, cancelled)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveReply:
        async with self.guard.admit(context, UNARY_CALL_SECONDS) as principal:
            self.registry.leave(request.session, request.reason, principal)
            reply = pb.LeaveReply()
            self._count_process_call(request, reply)
            return reply

    async def GetTask(self, request: pb.TaskRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TaskChunk | bytes]:
        async with self.guard.admit(context, self.stream_seconds) as principal:
            try:
                task = await self._wait_for_task(request, principal)
            except Rejected as error:
                await context.abort(error.code, str(error))
            if task is None or task.kind == TaskKind.DONE:
                chunk = pb.TaskChunk(header=pb.TaskHeader(kind=pb.DONE, outcome=int(task.outcome)) if task
                                     else pb.TaskHeader(kind=pb.IDLE))
                self._count_process_call(request, chunk)
                yield chunk
                return
            request_bytes = request.ByteSize()
            self.ledger.add(task.round, task.client_id, "up",
                            _with_secagg(_control(request_bytes), _secagg_bytes(task, request_bytes)))
            sent = False

            def cut_unless_sent(_: grpc.aio.ServicerContext) -> None:
                # a stream the client cancelled or the transport reset may be abandoned by gRPC
                # without this generator hearing of it: the call's end is the one sure signal.
                # The task stays with its process, whose next poll does not list it: sent again
                if not sent:
                    self.board.stream_cut(task, "the task stream ended before the task was sent")

            context.add_done_callback(cut_unless_sent)
            try:
                async with self.downloads:
                    for chunk in self._task_chunks(task, request):
                        yield chunk
            except Exception as error:  # noqa: BLE001 - any failure while sending drops only this task
                sent = True
                self.board.fail_task(task, f"sending the task failed: {error}")
                raise
            sent = True

    def _count_process_call(self, request, reply) -> None:
        """Bytes of a call that belongs to a process, not one client, in the current round."""
        round_number = self.coordinator.current_round
        self.ledger.add(round_number, PROCESS, "up", _control(request.ByteSize()))
        self.ledger.add(round_number, PROCESS, "down", _control(reply.ByteSize()))

    async def _wait_for_task(self, request: pb.TaskRequest, principal) -> Task | None:
        """Long-poll: the process's next task, DONE, or None after ``wait_seconds`` (or when a
        newer poll of the same process supersedes this one)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(request.wait_seconds, MAX_POLL_SECONDS))
        waiter = LoopWaiter(loop)
        cancelled = False
        try:
            while True:
                waiter.event.clear()
                task = self.board.poll(request.session, waiter, principal, request.held_tasks)
                remaining = deadline - loop.time()
                if task is not None or waiter.superseded or remaining <= 0:
                    return task
                try:
                    await asyncio.wait_for(waiter.event.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            cancelled = True  # the caller's connection closed, or it cancelled the poll
            raise
        finally:
            self.board.end_poll(request.session, waiter, cancelled)

    def _task_chunks(self, task: Task, request: pb.TaskRequest) -> Iterator[pb.TaskChunk | bytes]:
        """The header alone, then the shared, serialized chunks of the tensors the process lacks."""
        specs, tensors = self.payloads.wire_forms(*self.coordinator.task_tensors(task, request.held_versions))
        first = pb.TaskChunk(header=task_header(task, specs))
        first_bytes = first.ByteSize()
        self.ledger.add(task.round, task.client_id, "down",
                        _with_secagg(_control(first_bytes), _secagg_bytes(task, first_bytes, first.header)))
        if self._first_stream(task):
            self._count_logical_task(task, request, first.header, specs)
        yield first
        chunks = self.payloads.chunks(specs, tensors, [tensor_part(spec.name) for spec in specs])
        encodings = self.payloads.encoding_bytes(specs)  # before a yield lets another task evict them
        for chunk, by_part in chunks:
            self.ledger.add(task.round, task.client_id, "down", by_part)
            yield chunk
        self.ledger.add_encodings("down", encodings)

    @staticmethod
    def _first_stream(task: Task) -> bool:
        """Whether this is the first stream of ``task`` to send its chunks."""
        first, task.logical_counted = not task.logical_counted, True
        return first

    def _count_logical_task(self, task: Task, request: pb.TaskRequest, header: pb.TaskHeader,
                            sent_specs: list[pb.TensorSpec]) -> None:
        """A task's logical bytes: its request without the process's held versions and tasks, its
        first message listing every tensor it names (``header`` lists ``sent_specs``) and naming
        the message size of a process alone, and every named tensor."""
        tensors = self.payloads.logical(self.coordinator.named_versions(task),
                                        lambda: self.payloads.wire_forms(*self.coordinator.task_tensors(task, {}))[0])
        missing_spec_bytes = tensors.header_spec_bytes - sum(tensors.spec_bytes[spec.name] for spec in sent_specs)
        named_chunk_bytes = self.logical_result_chunk_bytes if task.result_chunk_bytes else 0
        header_bytes = logical_header_bytes(header, missing_spec_bytes, named_chunk_bytes)
        request_bytes = pb.TaskRequest(session=request.session, wait_seconds=request.wait_seconds).ByteSize()
        self.ledger.add_logical(task.round, task.client_id, "up",
                                _with_secagg(_control(request_bytes), _secagg_bytes(task, request_bytes)), {})
        header_parts = _with_secagg({"control": header_bytes}, _secagg_bytes(task, header_bytes, header))
        self.ledger.add_logical(task.round, task.client_id, "down", {**tensors.by_part, **header_parts},
                                tensors.by_unit)

    async def SubmitResult(self, request_iterator: AsyncIterator[ReceivedChunk],
                           context: grpc.aio.ServicerContext) -> pb.SubmitReply:
        async with self.guard.admit(context, self.stream_seconds) as principal:
            chunks = aiter(request_iterator)  # ReceivedChunk: see add_to_server
            first = await anext(chunks, None)
            try:
                header = check_first_chunk(first)
                result = result_info(header)
                task = self.board.result_task(result, principal)
            except DuplicateResult:
                return DUPLICATE
            except InvalidResult as error:
                await context.abort(error.code, str(error))
            except Rejected as error:
                self.ledger.refuse(first.size.total)
                await context.abort(error.code, str(error))
            received = Received(task)
            parts = [tensor_part(spec.name) for spec in header.tensors]
            # measured now, its pieces read again once a slot is free: no copy of them waits for one
            received.secagg_header_bytes = _secagg_bytes(task, first.size.control, header)
            received.add(_with_secagg(bytes_by_part(first.size, parts), received.secagg_header_bytes), "up")
            reply = pb.SubmitReply(accepted=True)
            settled = False  # handed to the fold (inline or on a fold thread), refused, or counted as cut

            def cut_unless_settled(_: grpc.aio.ServicerContext) -> None:
                # a call the client cancelled or the transport reset may be abandoned by gRPC
                # while it waits for an upload slot or a chunk: the call's end is the one sure signal
                if not settled:
                    self.board.stream_cut(task, "the result stream ended early", received.total())

            context.add_done_callback(cut_unless_settled)
            try:
                check_header(result, header.tensors, self.coordinator.expected_uploads(task))
                named_chunk_bytes = self.logical_result_chunk_bytes if task.result_chunk_bytes else 0
                received.logical_tensors = LogicalTensors.of(
                    header.tensors, self.coordinator.config.server.largest_result_message(named_chunk_bytes))
                received.logical_header_bytes = first.size.control
                async with self.uploads.staging(header.tensors) as staging:
                    largest = self.coordinator.config.server.largest_result_message(task.result_chunk_bytes)
                    tensors = await self._receive(received, first, chunks, parts, staging, largest)
                    reply_bytes = reply.ByteSize()
                    received.add(_with_secagg(_control(reply_bytes), _secagg_bytes(task, reply_bytes)), "down")
                    accept = partial(self.coordinator.accept, task, result, tensors,
                                     commit=lambda: received.commit(self.ledger))
                    settled = True
                    if self.fold_pool is None:
                        accept()
                    else:
                        await _run_to_end(asyncio.get_running_loop().run_in_executor(self.fold_pool, accept))
            except DuplicateResult:
                return DUPLICATE
            except IncompleteMessage as error:
                settled = True
                self.board.stream_cut(task, f"the result stream ended early ({error})", received.total())
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"the result stream ended early ({error}); "
                                                                 "send it again")
            except (Rejected, WireError) as error:
                settled = True
                if self.board.fail_task(task, f"result rejected: {error}"):
                    self.ledger.refuse(received.total())
                await context.abort(RESULT_REJECTED, f"result rejected: {error}")
            except BaseException:  # cancelled, or the stream broke off: its client sends it again
                if not settled:
                    settled = True
                    self.board.stream_cut(task, "the result stream ended early", received.total())
                raise
            return reply

    async def _receive(self, received: Received, first: ReceivedChunk, rest: AsyncIterator[ReceivedChunk],
                       parts: list[str], staging: dict, largest: int) -> dict:
        """Read the pieces of a result whose header was checked against its task, in messages of
        at most ``largest`` bytes."""
        assembler = TensorAssembler(first.header.tensors, into=staging)
        assembler.add(first.pieces)
        async for chunk in rest:
            received.add(bytes_by_part(chunk.size, parts), "up")
            check_later_chunk(chunk, largest)
            assembler.add(chunk.pieces)
        tensors = assembler.tensors()
        received.encodings = assembler.encoding_bytes()
        return tensors


def _serialize_task_chunk(chunk: pb.TaskChunk | bytes) -> bytes:
    """A task stream's message: tensor chunks come serialized already (shared by the tasks that
    send them, :class:`~fedpart.server.transport.transfers.TaskPayloads`), headers as messages."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


def add_to_server(service: CoordinatorService, server: grpc.aio.Server) -> None:
    """Serve ``service`` as ``proto/fedpart.proto``'s Coordinator. Unlike the generated
    ``add_CoordinatorServicer_to_server``, tensor chunks skip protobuf's message objects at this
    edge: a task's are sent as the bytes :class:`TaskPayloads` serialized once a round, and a
    result's are read by :func:`~fedpart.common.wire.tensors.read_chunk` into views of the received bytes
    (parsing them into messages copied every piece twice and measuring them re-encoded it). The
    bytes on the wire are the same."""
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            service.Join, request_deserializer=pb.JoinRequest.FromString,
            response_serializer=pb.JoinReply.SerializeToString),
        "GetTask": grpc.unary_stream_rpc_method_handler(
            service.GetTask, request_deserializer=pb.TaskRequest.FromString,
            response_serializer=_serialize_task_chunk),
        "SubmitResult": grpc.stream_unary_rpc_method_handler(
            service.SubmitResult, request_deserializer=partial(read_chunk, pb.ResultHeader),
            response_serializer=pb.SubmitReply.SerializeToString),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            service.Heartbeat, request_deserializer=pb.HeartbeatRequest.FromString,
            response_serializer=pb.HeartbeatReply.SerializeToString),
        "Leave": grpc.unary_unary_rpc_method_handler(
            service.Leave, request_deserializer=pb.LeaveRequest.FromString,
            response_serializer=pb.LeaveReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def _run_to_end(future: asyncio.Future) -> None:
    """Await a fold even when the call is cancelled meanwhile: the staging tensors it reads
    return to the pool only after it ended."""
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


class Received:
    """Bytes of one result stream (and its reply), held until the result is accepted: they enter
    the ledger together with the result, so a round's record never misses them. Logically the
    result is its header and its tensors in messages of the size a process alone is told."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.by_direction: dict[str, dict[str, int]] = {"up": {}, "down": {}}
        self.encodings: dict[str, dict[str, int]] = {}  # uploaded tensor bytes by encoding
        self.logical_header_bytes = 0
        self.secagg_header_bytes = 0  # of the header's bytes, those secure aggregation costs
        self.logical_tensors = LogicalTensors({}, {}, {})

    def add(self, by_part: dict[str, int], direction: str) -> None:
        counts = self.by_direction[direction]
        for part, count in by_part.items():
            counts[part] = counts.get(part, 0) + count

    def total(self) -> int:
        return sum(self.by_direction["up"].values())

    def commit(self, ledger: ByteLedger) -> None:
        round_number, client = self.task.round, self.task.client_id
        for direction, by_part in self.by_direction.items():
            ledger.add(round_number, client, direction, by_part)
        ledger.add_encodings("up", self.encodings)
        tensors = self.logical_tensors
        header = _with_secagg({"control": self.logical_header_bytes}, self.secagg_header_bytes)
        ledger.add_logical(round_number, client, "up", {**tensors.by_part, **header}, tensors.by_unit)
        ledger.add_logical(round_number, client, "down", self.by_direction["down"], {})
