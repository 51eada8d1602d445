"""The client side of fedpart's protocol, written once for every kind of client process.

A :class:`Session` owns one process's conversation with the coordinator (``proto/fedpart.proto``):
the join, heartbeats while no long poll waits, the long poll for the next task, the result upload,
the goodbye, and what to do when any of them fails. What a task means is its *worker*'s business:
``fedpart client`` trains and evaluates (:mod:`fedpart.client.runtime`), the load generator answers
without computing (:mod:`lab.virtual`); both run on this one session, so a protocol
change is made here once and the load tests exercise the real protocol.

Delivery is at least once (docs/architecture.md, Faults; :mod:`fedpart.server.engine.task_board`):

- every poll lists the tasks this process holds (received, not yet answered); a task the server
  gave the process but the list lacks was lost on the way, and the server sends it again;
- a task stream that breaks off or ends short is dropped and the poll is made again;
- a result is sent until the server answers it: taken, ``duplicate`` (a copy it had already taken,
  whose acknowledgement was lost), or refused for a reason that sending again cannot change;
- while the server cannot be reached the calls are tried again with capped exponential backoff,
  for ``connect_timeout`` before the first join and ``reconnect_timeout`` once the server was seen.

A dead connection (a vanished peer, a NAT that dropped its mapping, a black-holed route) is found
by keepalive pings within :data:`~fedpart.common.wire.protocol.KEEPALIVE_SECONDS` +
:data:`~fedpart.common.wire.protocol.KEEPALIVE_TIMEOUT_SECONDS`, and the call on it fails and is tried
again on a new connection.

A session runs on an asyncio event loop. The load generator runs thousands of them on one loop;
``fedpart client`` runs one on a loop thread of its own (:class:`SessionThread`) so that its main
thread trains; SIGINT or SIGTERM end a wait for the session, or the training within a few steps.
A poll and result uploads may run at the same time (the worker fetches its next task and sends
earlier results while it trains): a lost session is joined again once, by whichever call found it
lost first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import grpc

from fedpart.common.process.exit_codes import ExitCode, StopRequest
from fedpart.common.process.limits import yield_to_training
from fedpart.common.wire.plans import ResultInfo, SecAggAnswer, TaskInfo, TaskKind
from fedpart.common.wire.protocol import (
    JOIN_REFUSED_CODES,
    KEEPALIVE_SECONDS,
    KEEPALIVE_TIMEOUT_SECONDS,
    NOT_YET_KEY,
    RETRY_LATER_CODES,
    UNKNOWN_SESSION,
    method_path,
)
from fedpart.common.wire.security import ClientSecurity
from fedpart.common.wire.serde import result_header, task_info
from fedpart.common.wire.tensors import IncompleteMessage, ReceivedChunk, WireError, read_chunk
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc

POLL_SECONDS = 20.0        # long-poll budget of one task request
TRANSFER_SECONDS = 600.0   # deadline for moving one task or result, on top of the poll
CONNECT_SECONDS = 120.0    # default connect_timeout: how long to keep trying a server that is not up yet
RECONNECT_SECONDS = 300.0  # default reconnect_timeout: how long to keep trying a server that went away
JOIN_SECONDS = 60.0        # deadline of one join call
LEAVE_SECONDS = 5.0        # deadline of the goodbye of a process that stops
FIRST_RETRY_SECONDS = 0.5  # while the server is unreachable, attempts are this far apart at first,
MAX_RETRY_SECONDS = 5.0    # doubling up to this (the channel's own reconnect backoff is the same)
HEARTBEAT_SECONDS = 5.0    # at most; shorter when server.heartbeat_timeout is short
HEARTBEAT_REPLY_SECONDS = 5.0  # a held heartbeat's deadline, past the time it asks to be held
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    # pings find a dead connection while a call waits on it, and keep NAT mappings alive while
    # the process trains for minutes
    ("grpc.keepalive_time_ms", int(KEEPALIVE_SECONDS * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_SECONDS * 1000)),
    # gRPC waits this long for the answer to any ping, keepalives included (its default outlasts
    # the keepalive bound, so a black-holed upload would fail late; with it, at the bound)
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_SECONDS * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    # keep pinging through a long poll that carries no data (by default pings stop after two,
    # and a connection black-holed later would go unnoticed past the keepalive bound)
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", int(FIRST_RETRY_SECONDS * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(MAX_RETRY_SECONDS * 1000)),
]

T = TypeVar("T")


class SessionError(RuntimeError):
    """The process cannot go on (the message says why)."""

    code = ExitCode.ERROR


class ServerNotReached(SessionError):
    """No server answered within ``connect_timeout``, or it stayed away for ``reconnect_timeout``."""

    code = ExitCode.UNREACHABLE


class ConnectionRefused(SessionError):
    """A connection that trying again cannot mend (an untrusted certificate, a wrong name, TLS
    against plaintext, an unknown host, a refused credential): the message says what to fix."""

    code = ExitCode.USAGE


class Sent(enum.Enum):
    """How the server answered a result."""

    TAKEN = "taken"
    DUPLICATE = "duplicate"  # a copy of a result it had taken already (the first answer was lost)
    REFUSED = "refused"      # for a reason sending again cannot change


@dataclass
class Backoff:
    """Capped exponential backoff between attempts to reach a lost server, bounded in total."""

    deadline: float
    delay: float = FIRST_RETRY_SECONDS
    attempts: int = 0

    def next_delay(self) -> float | None:
        """Seconds to wait before the next attempt; None once the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        delay = min(self.delay, remaining)
        self.delay = min(2 * self.delay, MAX_RETRY_SECONDS)
        self.attempts += 1
        return delay


def heartbeat_interval(heartbeat_timeout: float) -> float:
    """Seconds between heartbeats: a few per ``server.heartbeat_timeout``, at most
    :data:`HEARTBEAT_SECONDS`."""
    return max(0.2, min(HEARTBEAT_SECONDS, heartbeat_timeout / 4))


def why(error: grpc.RpcError) -> str:
    """A gRPC error in one short line for the log."""
    details = (error.details() or "").splitlines()
    return f"{error.code().name}: {details[0][:200] if details else 'no details'}"


class TaskReader(Protocol):
    """Takes in the tensor pieces of one task stream (see :class:`~fedpart.common.wire.tensors.TensorAssembler`)."""

    def add(self, pieces: list[tuple[int, memoryview]]) -> None: ...

    def finish(self) -> Any:
        """What the worker makes of the tensors; raises
        :class:`~fedpart.common.wire.tensors.IncompleteMessage` when bytes are missing."""


@dataclass
class ReceivedTask:
    """A task as it arrived: its plain values, its header (with the tensor specs) and what the
    worker's :class:`TaskReader` made of its tensors."""

    info: TaskInfo
    header: pb.TaskHeader
    payload: Any = None


@dataclass
class Answer:
    """What a worker answers a task with: the result's values, the specs of its tensors, and
    the serialized ``ResultChunk`` messages of their pieces (made anew for each attempt);
    ``on_taken`` runs once the server has the result."""

    num_samples: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    specs: list[pb.TensorSpec] = field(default_factory=list)
    pieces: Callable[[], Iterable[bytes]] = lambda: ()
    on_taken: Callable[[], None] = lambda: None
    secagg: SecAggAnswer | None = None    # the answer to a step of secure aggregation


class SessionEvents:
    """What a session tells its process as it goes; each is a no-op here. ``fedpart client``
    logs, the load generator counts."""

    def log(self, message: str, level: int = logging.INFO) -> None:
        """A line for the process's log, at ``level``."""

    def call_failed(self, rpc: str, error: grpc.RpcError) -> None:
        """A call ended with ``error`` (it may be tried again)."""

    def joined(self, again: bool) -> None:
        """The process joined (``again``: after the server had lost its session)."""

    def heartbeat(self, known: bool) -> None:
        """A heartbeat was answered; ``known`` is False when the server had lost the session."""

    def polled(self, kind: TaskKind, tensor_bytes: int) -> None:
        """A poll was answered with a task of ``kind`` carrying ``tensor_bytes``."""

    def answered(self, task: TaskInfo, sent: Sent, nbytes: int) -> None:
        """A result was answered ``sent`` after its last attempt's ``nbytes`` bytes."""


class Session:
    """One client process's conversation with the coordinator. Use it on one event loop:
    ``async with session:`` opens and closes its channel."""

    def __init__(self, server: str, security: ClientSecurity, join_request: Callable[[], pb.JoinRequest],
                 events: SessionEvents | None = None, connect_timeout: float = CONNECT_SECONDS,
                 reconnect_timeout: float = RECONNECT_SECONDS,
                 channel_options: list[tuple[str, object]] | None = None,
                 diagnose: Callable[[grpc.RpcError], str | None] | None = None) -> None:
        self.server = server
        self.security = security
        self.events = events or SessionEvents()
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout
        self.session = ""
        self.run_id = ""
        self.versions: dict[str, int] = {}  # global tensors the process holds, by version
        self.call_timeout = TRANSFER_SECONDS + POLL_SECONDS  # lowered to the server's once joined
        self._join_request = join_request
        self._diagnose = diagnose
        self._channel_options = channel_options if channel_options is not None else CHANNEL_OPTIONS
        self._held: set[int] = set()  # tasks received and not yet answered
        self._outage: Backoff | None = None  # set while the server is unreachable
        self._poll_waiting = False  # a long poll waits unanswered: the server counts it as a sign of life
        self._poll_answered = asyncio.Event()  # a waiting poll ended: heartbeats take over at once
        self._rejoining = asyncio.Lock()  # one join again at a time
        self._another_run: str | None = None  # set once a join again found the server running another run
        self._heartbeats: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> Session:
        self._channel = self.security.aio_channel(self.server, self._channel_options)
        stub = pb_grpc.CoordinatorStub(self._channel)
        metadata = self.security.call_metadata()  # every call carries the token
        self._join_call = partial(stub.Join, metadata=metadata)
        self._leave_call = partial(stub.Leave, metadata=metadata)
        self._heartbeat_call = partial(stub.Heartbeat, metadata=metadata)
        # raw chunk bytes both ways: read_chunk takes pieces as views, results go out serialized once
        self._get_task = partial(self._channel.unary_stream(
            method_path("GetTask"), request_serializer=pb.TaskRequest.SerializeToString,
            response_deserializer=partial(read_chunk, pb.TaskHeader)), metadata=metadata)
        self._submit_result = partial(self._channel.stream_unary(
            method_path("SubmitResult"), request_serializer=None, response_deserializer=pb.SubmitReply.FromString),
            metadata=metadata)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            await asyncio.gather(self._heartbeats, return_exceptions=True)
        await self._channel.close()

    # ------------------------------------------------------------------ join and leave

    async def join(self) -> pb.JoinReply:
        """The first join: tried again with backoff while no server answers (not up yet,
        restarting) or it cannot take the join now, for ``connect_timeout`` seconds; raises
        :class:`ServerNotReached` after that, :class:`ConnectionRefused` at once for a failure
        that trying again cannot mend, :class:`SessionError` for a refused join."""
        self.events.log(f"connecting to {self.server} ({self.security.describe()}); trying for up to "
                        f"{self.connect_timeout:.0f} s (--connect-timeout)")
        backoff = Backoff(time.monotonic() + self.connect_timeout)
        diagnosed: set[str] = set()  # each distinct failure is looked into once
        while True:
            try:
                reply = await self._join_call(self._join_request(), timeout=max(1.0, min(
                    JOIN_SECONDS, backoff.deadline - time.monotonic())))
                break
            except grpc.aio.AioRpcError as error:
                self.events.call_failed("Join", error)
                if error.code() not in RETRY_LATER_CODES:
                    raise self._refused(error) from error
                if self._diagnose is not None and why(error) not in diagnosed and not _server_said_not_yet(error):
                    diagnosed.add(why(error))
                    problem = await asyncio.get_running_loop().run_in_executor(None, self._diagnose, error)
                    if problem:
                        raise ConnectionRefused(problem) from error
                delay = backoff.next_delay()
                if delay is None:
                    raise ServerNotReached(f"no server answered at {self.server} within {self.connect_timeout:.0f} s "
                                           f"(--connect-timeout); last error: {why(error)}") from error
                self.events.log(f"attempt {backoff.attempts}: {self.server} did not take the join ({why(error)}); "
                                f"next attempt in {delay:.1f} s")
                await asyncio.sleep(delay)
        self.session, self.run_id = reply.session, reply.run_id
        self.events.joined(again=False)
        return reply

    async def joined_run(self, call_timeout: float, heartbeat_timeout: float, first_beat_after: float = 0.0) -> None:
        """The run's config is known: calls ask for deadlines within ``call_timeout``, and
        heartbeats start (the first after ``first_beat_after`` seconds)."""
        self.call_timeout = min(self.call_timeout, call_timeout)
        self._heartbeats = asyncio.create_task(self._beat(heartbeat_interval(heartbeat_timeout), first_beat_after))

    async def _rejoin(self, lost: str) -> None:
        """The server does not know session ``lost`` (it dropped the process after missed
        heartbeats, or it is a resumed server): join the same run again, keeping the held tensor
        versions, unless another call already did. A server that now runs another run ends the
        process: every call that finds its session lost after that ends it at once, without joining
        again (the other run would take this process for one of its own)."""
        async with self._rejoining:
            if self._another_run is not None:
                raise SessionError(self._another_run)
            if self.session == lost:
                await self._join_again()

    async def _join_again(self) -> None:
        try:
            reply = await self._join_call(self._join_request(), timeout=JOIN_SECONDS)
        except grpc.aio.AioRpcError as error:
            self.events.call_failed("Join", error)
            if error.code() in RETRY_LATER_CODES:
                await self._back_off(error)
                return
            raise self._refused(error) from error
        self._server_back()
        if reply.run_id != self.run_id:
            self._another_run = (f"the server at {self.server} now runs another run ({reply.run_id}, this process "
                                 f"served {self.run_id}); stopping")
            await self._leave_other_run(reply.session)
            raise SessionError(self._another_run)
        self.session = reply.session
        self._held.clear()  # tasks of the old session were closed with it
        self.events.joined(again=True)
        self.events.log(f"joined run {reply.run_id} again (the server had dropped this process or was restarted)")

    async def _leave_other_run(self, session: str) -> None:
        """Leave the other run this process was joined to on the way (the server frees the client
        ids at once instead of holding them for this process until its heartbeat timeout)."""
        try:
            await self._leave_call(pb.LeaveRequest(session=session, reason="this process served another run"),
                                   timeout=LEAVE_SECONDS)
        except grpc.aio.AioRpcError as error:
            self.events.call_failed("Leave", error)

    def _refused(self, error: grpc.RpcError) -> SessionError:
        """The error that ends a process whose join (or, once its credential was revoked, whose
        call) was refused: one the operator must mend (a refused credential, client ids that are not
        the run's or the credential's, a credential another live process holds) is a
        :class:`ConnectionRefused` that says what to change."""
        said = f"join refused ({error.code().name}): {error.details()}"
        if error.code() not in JOIN_REFUSED_CODES:
            return SessionError(said)
        diagnosed = self._diagnose(error) if self._diagnose is not None else None
        return ConnectionRefused(diagnosed or said)

    async def leave(self, reason: str) -> None:
        """Tell the server why this process stops (best effort: the server may be gone)."""
        try:
            await self._leave_call(pb.LeaveRequest(session=self.session, reason=reason), timeout=LEAVE_SECONDS)
        except grpc.aio.AioRpcError as error:
            self.events.call_failed("Leave", error)

    async def _beat(self, interval: float, first_after: float) -> None:
        """A sign of life while no long poll waits: a heartbeat the server holds open for
        ``interval``, then the next, so that a call of this process is open nearly always; the
        server counts a waiting poll as one, so thousands of idle processes do not send thousands
        of heartbeats. An open call is how the server tells a live process from a killed one: a
        process killed and started again takes its clients back at once, a second process with
        the same credential is refused (``server/engine/registry.py``)."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(first_after)
        while True:
            started = loop.time()
            if not self._poll_waiting:
                try:
                    reply = await self._heartbeat_call(pb.HeartbeatRequest(session=self.session, hold_seconds=interval),
                                                       timeout=interval + HEARTBEAT_REPLY_SECONDS)
                except grpc.aio.AioRpcError as error:
                    self.events.call_failed("Heartbeat", error)
                else:
                    self.events.heartbeat(reply.known)
            # the next at the interval, or as soon as a waiting poll is answered (asyncio.wait, not
            # wait_for: Python 3.11's wait_for may swallow the cancellation that stops this loop)
            answered = asyncio.ensure_future(self._poll_answered.wait())
            try:
                await asyncio.wait((answered,), timeout=max(0.0, interval - (loop.time() - started)))
            finally:
                answered.cancel()
            self._poll_answered.clear()

    # ------------------------------------------------------------------ tasks

    async def next_task(self, reader: Callable[[pb.TaskHeader], TaskReader]) -> ReceivedTask:
        """The next task to work on, or DONE: long polls until one arrives whole, sending the
        polls again after a lost stream, an unreachable server (with backoff, for
        ``reconnect_timeout``) or a lost session (joining again). ``reader`` makes the
        :class:`TaskReader` for a task's tensors. The task is held until :meth:`answer`."""
        while True:
            session = self.session
            request = pb.TaskRequest(session=session, held_versions=self.versions, wait_seconds=POLL_SECONDS,
                                     held_tasks=sorted(self._held))
            try:
                received = await self._poll(request, reader)
            except grpc.aio.AioRpcError as error:
                self.events.call_failed("GetTask", error)
                if error.code() in RETRY_LATER_CODES:
                    await self._back_off(error)
                elif error.code() == UNKNOWN_SESSION:
                    await self._rejoin(session)
                elif error.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise self._refused(error) from error  # the credential was revoked meanwhile
                else:
                    raise SessionError(f"server refused the task request ({error.code().name}): "
                                       f"{error.details()}") from error
                continue
            except IncompleteMessage as error:
                self.events.log(f"a task stream ended short ({error}); asking again")
                continue
            self._server_back()
            if received is None:
                continue
            if received.info.kind != TaskKind.DONE:
                self._held.add(received.info.task_id)
            return received

    async def _poll(self, request: pb.TaskRequest, reader: Callable[[pb.TaskHeader], TaskReader]
                    ) -> ReceivedTask | None:
        """One long poll, read to its end; None for IDLE. Versions of the received tensors are
        held from then on."""
        return await self._read_task(self._get_task(request, timeout=self.call_timeout), reader)

    async def _read_task(self, call, reader: Callable[[pb.TaskHeader], TaskReader]) -> ReceivedTask | None:
        """The task stream of ``call``, read to its end."""
        header: pb.TaskHeader | None = None
        tensors: TaskReader | None = None
        received = 0
        self._poll_waiting = True
        try:
            async for chunk in call:
                if self._poll_waiting:  # from the first chunk on: heartbeats while the rest arrives
                    self._poll_waiting = False
                    self._poll_answered.set()
                header, tensors = self._take_chunk(chunk, header, tensors, reader)
                received += sum(len(data) for _, data in chunk.pieces)
        finally:
            self._poll_waiting = False
            self._poll_answered.set()
        if header is None:
            raise SessionError("the server answered a task request with an empty stream")
        info = _task(header)
        self.events.polled(info.kind, received)
        if info.kind == TaskKind.IDLE:
            return None
        payload = _finished(tensors, header) if tensors is not None else None
        self.versions.update({spec.name: spec.version for spec in header.tensors})
        return ReceivedTask(info, header, payload)

    @staticmethod
    def _take_chunk(chunk: ReceivedChunk, header: pb.TaskHeader | None, tensors: TaskReader | None,
                    reader: Callable[[pb.TaskHeader], TaskReader]) -> tuple[pb.TaskHeader, TaskReader | None]:
        if chunk.malformed:
            raise SessionError(f"the server sent a malformed task stream: {chunk.malformed}")
        if chunk.header is not None:
            if header is not None:
                raise SessionError("the server sent a second header inside one task stream")
            header = chunk.header
            if header.kind in (pb.TRAIN, pb.EVALUATE, pb.SECAGG):
                tensors = _checked(reader, header)
        elif header is None:
            raise SessionError("the first chunk of a task stream carries no header")
        if chunk.pieces:
            if tensors is None:
                raise SessionError("the server sent tensor pieces with a task that carries none")
            try:
                tensors.add(chunk.pieces)
            except WireError as error:
                raise SessionError(f"task {header.task_id}: {error}") from error
        return header, tensors

    async def answer(self, task: ReceivedTask, answer: Answer) -> Sent:
        """Send a task's result until the server answers it, and let the task go. A stream the
        server could not take (unreachable, busy, or the transport broke it) is sent again with
        backoff, for ``reconnect_timeout``; the server folds a result once, however many copies
        arrive."""
        info = task.info
        try:
            while True:
                session = self.session
                header = result_header(ResultInfo(session, info.task_id, info.client_id, info.round,
                                                  num_samples=answer.num_samples, metrics=answer.metrics,
                                                  secagg=answer.secagg),
                                       answer.specs)
                first = pb.ResultChunk(header=header).SerializeToString()
                counted = _Counted(_chained(first, answer.pieces()))
                try:
                    reply = await self._send_result(counted)
                except grpc.aio.AioRpcError as error:
                    self.events.call_failed("SubmitResult", error)
                    if error.code() in RETRY_LATER_CODES:
                        await self._back_off(error)
                        continue
                    if error.code() == UNKNOWN_SESSION:
                        self.events.log(f"result for client {info.client_id} round {info.round} lost: the server "
                                        "had dropped this process and its tasks")
                        await self._rejoin(session)
                    else:
                        self.events.log(f"result for client {info.client_id} round {info.round} not taken: "
                                        f"{error.details()}", logging.WARNING)
                    self.events.answered(info, Sent.REFUSED, counted.nbytes)
                    return Sent.REFUSED
                self._server_back()
                sent = Sent.DUPLICATE if reply.duplicate else Sent.TAKEN
                answer.on_taken()
                self.events.answered(info, sent, counted.nbytes)
                return sent
        finally:
            self._held.discard(info.task_id)

    async def _send_result(self, counted: _Counted) -> pb.SubmitReply:
        """One attempt at sending a result."""
        return await self._submit_result(iter(counted), timeout=self.call_timeout)

    # ------------------------------------------------------------------ reaching the server

    async def _back_off(self, error: grpc.RpcError) -> None:
        """The server did not answer: wait before the next attempt (capped exponential backoff),
        and give up once it has been unreachable for ``reconnect_timeout``."""
        if self._outage is None:
            self._outage = Backoff(time.monotonic() + self.reconnect_timeout)
            self.events.log(f"lost the server at {self.server} ({error.code().name}); trying to reconnect for "
                            f"up to {self.reconnect_timeout:.0f} s")
        delay = self._outage.next_delay()
        if delay is None:
            raise ServerNotReached(f"the server at {self.server} was unreachable for {self.reconnect_timeout:.0f} s "
                                   f"(--reconnect-timeout); last error: {why(error)}")
        self.events.log(f"server unreachable; attempt {self._outage.attempts} in {delay:.1f} s")
        await asyncio.sleep(delay)

    def _server_back(self) -> None:
        if self._outage is not None:
            self.events.log(f"the server answers again after {self._outage.attempts} attempts")
            self._outage = None


def _server_said_not_yet(error: grpc.aio.AioRpcError) -> bool:
    """Whether the server itself answered the join UNAVAILABLE (another process still holds the
    credential): then the connection works and needs no diagnosis."""
    return any(key == NOT_YET_KEY for key, _ in error.trailing_metadata() or ())


def _task(header: pb.TaskHeader) -> TaskInfo:
    try:
        return task_info(header)
    except WireError as error:
        raise SessionError(f"the server sent a task this client cannot read: {error}") from error


def _checked(reader: Callable[[pb.TaskHeader], TaskReader], header: pb.TaskHeader) -> TaskReader:
    try:
        return reader(header)
    except WireError as error:
        raise SessionError(f"task {header.task_id}: {error}") from error


def _finished(tensors: TaskReader, header: pb.TaskHeader) -> Any:
    """The worker's payload of a whole task stream; a short one raises IncompleteMessage."""
    try:
        return tensors.finish()
    except IncompleteMessage:
        raise
    except WireError as error:
        raise SessionError(f"task {header.task_id}: {error}") from error


def _chained(first: bytes, rest: Iterable[bytes]) -> Iterable[bytes]:
    yield first
    yield from rest


class _Counted:
    """Serialized chunks, counting the bytes handed to gRPC."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = chunks
        self.nbytes = 0

    def __iter__(self):
        for chunk in self._chunks:
            self.nbytes += len(chunk)
            yield chunk


class SessionThread:
    """An event loop on a thread of its own, for a process whose main thread does the work:
    :meth:`call` runs a session's coroutine there and waits for it. The thread yields to the
    training thread (:func:`~fedpart.common.process.limits.yield_to_training`). A stop handed to
    :attr:`stops` (SIGINT, SIGTERM: :func:`~fedpart.common.process.exit_codes.signals_to`) ends the wait
    under way or the next one: the coroutine is cancelled and the stop raised, once."""

    def __init__(self) -> None:
        self.stops = StopRequest()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="session", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        yield_to_training()  # and so do gRPC's threads, which the channel starts from here
        self._loop.run_forever()

    def call(self, coroutine: Awaitable[T]) -> T:
        return self.wait(self.submit(coroutine))

    def submit(self, coroutine: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the loop; the caller goes on (:meth:`wait` for its outcome)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def wait(self, future: concurrent.futures.Future[T]) -> T:
        """The outcome of a submitted coroutine; a stop cancels it and is raised."""
        try:
            concurrent.futures.wait((future, self.stops.arrived), return_when=concurrent.futures.FIRST_COMPLETED)
            self.stops.take()
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
