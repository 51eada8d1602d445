"""The client's side of the data port (:mod:`fedpart.common.data_link`): ``GetTask`` and
``SubmitResult`` over TLS sockets of their own, read and written by blocking threads.

With TLS, a connection's bytes go in frames sealed under keys agreed in its TLS handshake
(:mod:`fedpart.common.sealed`). :class:`DataLink` offers the two calls in the shape of gRPC's
asyncio calls, so that :class:`~fedpart.client.session.Session` uses either path with the same
code: a task call is iterated for its chunks, a result call is awaited for its reply, and a failed
call raises ``grpc.aio.AioRpcError`` with the code the server (or the broken connection) gave:
UNAVAILABLE for a connection that broke, DEADLINE_EXCEEDED for one that went silent, as gRPC
would. A data port that cannot be reached at all raises :class:`LinkUnreachable` instead: the
session then keeps to gRPC until it joins again.

Connections are kept between calls (one per call at a time: a poll and an upload may run
together) and closed after any failure. The link's threads yield to the training thread
(:func:`~fedpart.common.limits.yield_to_training`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc

from fedpart.common.data_link import (
    CALL_HEAD,
    FRAME,
    Connection,
    GET_TASK,
    LENGTH,
    MAGIC,
    MAX_DETAILS_BYTES,
    MESSAGE,
    PROGRESS_SECONDS,
    STATUS,
    SUBMIT_RESULT,
    LinkBroken,
    largest_message,
    read_exactly,
    send_prefixed,
    shut,
    tune,
)
from fedpart.common.limits import yield_to_training
from fedpart.common.sealed import SealedSocket, seal
from fedpart.common.security import ClientSecurity
from fedpart.common.wire import ReceivedChunk, read_chunk
from fedpart.proto import fedpart_pb2 as pb

CONNECT_SECONDS = 10.0  # to connect and finish the TLS handshake
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_END = object()


class LinkUnreachable(ConnectionError):
    """No connection to the data port could be made (refused, unresolvable, TLS refused)."""


def _failed(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class DataLink:
    """Calls on the data port at ``host:port``, with the TLS and token of ``security``."""

    def __init__(self, host: str, port: int, security: ClientSecurity) -> None:
        self.address = f"{host}:{port}"
        self._host, self._port = host.strip("[]"), port
        self._tls = security.ssl_context()
        self._server_name = security.server_name or self._host
        self._token = (security.token or "").encode() if not security.insecure else b""
        self._largest = largest_message(0)  # task messages keep within gRPC's limit (server.chunk_bytes)
        self._idle: list[Connection] = []
        self._closed = False
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="data-link",
                                           initializer=yield_to_training)

    def close(self) -> None:
        """Close the idle connections; a call under way ends on its own and closes its connection."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            shut(sock)
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the two calls

    def get_task(self, request: pb.TaskRequest, timeout: float) -> AsyncIterator[ReceivedChunk]:
        """The task stream of a long poll, as gRPC's ``GetTask`` (iterate it)."""
        return self._streamed(partial(self._get_task, request.SerializeToString(), request.wait_seconds), timeout)

    async def submit_result(self, chunks: Iterable[bytes], timeout: float) -> pb.SubmitReply:
        """Send a result's serialized chunks, as gRPC's ``SubmitResult``; returns the reply."""
        replies = [reply async for reply in self._streamed(partial(self._submit_result, chunks), timeout)]
        if len(replies) != 1:
            raise _failed(grpc.StatusCode.INTERNAL, f"the server answered a result with {len(replies)} messages")
        return pb.SubmitReply.FromString(replies[0])

    async def _streamed(self, call, timeout: float) -> AsyncIterator:
        """Run ``call`` on a thread of the link, yielding what it hands over as it arrives."""
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue = asyncio.Queue()
        held: list[Connection] = []  # the call's connection, to cut it if the caller goes away
        deadline = time.monotonic() + timeout

        def hand(item) -> None:
            loop.call_soon_threadsafe(arrived.put_nowait, item)

        done = loop.run_in_executor(self._threads, self._run, call, deadline, hand, held)
        finished = False
        try:
            while True:
                item = await arrived.get()
                if item is _END:
                    finished = True
                    break
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                for sock in held:
                    shut(sock)
            await asyncio.wait([done])

    def _run(self, call, deadline: float, hand, held: list[Connection]) -> None:
        """One call on a connection of the pool (or a new one); whatever happens is handed over."""
        try:
            sock = self._connection()
        except (OSError, ssl.SSLError) as error:
            hand(LinkUnreachable(f"cannot reach the data port at {self.address}: {error}"))
            return
        held.append(sock)
        try:
            code, details = call(sock, deadline, hand)
        except (OSError, LinkBroken, ssl.SSLError) as error:
            shut(sock)
            silent = isinstance(error, TimeoutError)  # socket.timeout is TimeoutError
            hand(_failed(grpc.StatusCode.DEADLINE_EXCEEDED if silent else grpc.StatusCode.UNAVAILABLE,
                         f"the data port connection {'went silent' if silent else 'broke'}: {error}"))
            return
        with self._lock:
            if self._closed or (isinstance(sock, SealedSocket) and sock.worn):
                shut(sock)
            else:
                self._idle.append(sock)
        hand(_END if code == grpc.StatusCode.OK else _failed(code, details))

    def _connection(self) -> Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        raw = socket.create_connection((self._host, self._port), timeout=CONNECT_SECONDS)
        try:
            tune(raw)
            if self._tls is None:
                return raw
            tls = self._tls.wrap_socket(raw, server_hostname=self._server_name)
        except BaseException:
            raw.close()
            raise
        try:
            return seal(tls, server_side=False)
        except BaseException:
            tls.close()
            raise

    def _head(self, method: int, deadline: float) -> bytes:
        deadline_ms = max(1, int((deadline - time.monotonic()) * 1000))
        return CALL_HEAD.pack(MAGIC, method, deadline_ms, len(self._token)) + self._token

    def _get_task(self, request: bytes, wait_seconds: float, sock: Connection, deadline: float,
                  hand) -> tuple[grpc.StatusCode, str]:
        sock.settimeout(_remaining(deadline))
        sock.sendall(self._head(GET_TASK, deadline) + LENGTH.pack(len(request)) + request + LENGTH.pack(0))
        # the server answers a long poll within its wait; then the task's messages follow
        return self._answer(sock, deadline, hand, lambda message: read_chunk(pb.TaskHeader, message),
                            first_wait=wait_seconds + PROGRESS_SECONDS)

    def _submit_result(self, chunks: Iterable[bytes], sock: Connection, deadline: float,
                       hand) -> tuple[grpc.StatusCode, str]:
        sock.settimeout(min(PROGRESS_SECONDS, _remaining(deadline)))
        sock.sendall(self._head(SUBMIT_RESULT, deadline))
        for chunk in chunks:
            send_prefixed(sock, LENGTH.pack(len(chunk)), chunk)
            if time.monotonic() > deadline:
                raise TimeoutError("the result did not go out within its deadline")
        sock.sendall(LENGTH.pack(0))
        return self._answer(sock, deadline, hand, bytes, first_wait=PROGRESS_SECONDS)

    def _answer(self, sock: Connection, deadline: float, hand, decode,
                first_wait: float) -> tuple[grpc.StatusCode, str]:
        """Read the server's frames: each message decoded and handed over; returns the status."""
        wait = first_wait
        while True:
            sock.settimeout(min(wait, _remaining(deadline)))
            kind, length = FRAME.unpack(read_exactly(sock, FRAME.size))
            wait = PROGRESS_SECONDS
            if kind == MESSAGE and length <= self._largest:
                hand(decode(read_exactly(sock, length)))
            elif kind == STATUS and 1 <= length <= 1 + MAX_DETAILS_BYTES:
                body = read_exactly(sock, length)
                code = _CODES.get(body[0], grpc.StatusCode.UNKNOWN)
                return code, bytes(body[1:]).decode(errors="replace")
            else:
                raise LinkBroken(f"the server sent a frame of kind {kind} and {length} bytes")


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the call's deadline passed")
    return remaining
