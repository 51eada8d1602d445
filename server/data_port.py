"""The server's data port: the task and result streams over TLS connections of their own
(:mod:`fedpart.common.data_link` says why and defines the framing).

Threads move the bytes: one accepts, and each connection has a thread that reads and writes its
socket, blocking (TLS records are encrypted and decrypted there, outside the event loop and with
the GIL released). The calls themselves run on the server's event loop, in the handlers of gRPC's
calls (:class:`~fedpart.server.service.CoordinatorService`) with a :class:`LinkContext` in place of
gRPC's: the same admission (the token, or the client certificate's common name; a bounded
deadline; a few calls per process), validation, upload slots, at-least-once delivery and ledger.

Bounds against a broken or hostile client: at most ``max_connections`` connections (more are
closed at once, and their processes keep to gRPC), the TLS handshake, the first call and each
call's head within :data:`HEAD_SECONDS`, a message every
:data:`~fedpart.common.data_link.PROGRESS_SECONDS` while a call streams, an idle connection closed
after :data:`IDLE_SECONDS`, a connection whose call was refused for its credential closed,
messages of at most :func:`~fedpart.common.data_link.largest_message` bytes, and a call ends by
its deadline like a gRPC call. A connection that breaks the framing is closed; a refused result is answered after
the rest of its messages were read (so the connection stays in step) and the connection stays.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from fedpart.common.data_link import (
    CALL_HEAD,
    GET_TASK,
    MAGIC,
    MAX_TOKEN_BYTES,
    MESSAGE,
    METHODS,
    PROGRESS_SECONDS,
    Connection,
    LinkBroken,
    largest_message,
    read_exactly,
    read_length,
    send_frame,
    send_status,
    shut,
    tune,
)
from fedpart.common.sealed import seal
from fedpart.common.security import ServerSecurity
from fedpart.common.wire import IncompleteMessage, ReceivedChunk, read_chunk
from fedpart.proto import fedpart_pb2 as pb

HEAD_SECONDS = 10.0        # the TLS handshake, and a call's head once its first byte came
IDLE_SECONDS = 900.0       # a connection without a call this long is closed
RESULT_WINDOW = 2          # result messages read ahead of the handler

T = TypeVar("T")


class CallAborted(Exception):
    """Raised by :meth:`LinkContext.abort`: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LinkContext:
    """What the call handlers ask of gRPC's ``ServicerContext``, for a call on the data port."""

    def __init__(self, loop: asyncio.AbstractEventLoop, token: str, common_name: str | None,
                 deadline_ms: int) -> None:
        self._deadline = loop.time() + deadline_ms / 1000 if deadline_ms else None
        self._loop = loop
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._auth = {"x509_common_name": [common_name.encode()]} if common_name else {}
        self._done: list[Callable[[Any], None]] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._done.append(callback)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallAborted(code, details)

    def ended(self) -> None:
        """The call is over, however it ended: run the done callbacks (gRPC's one sure signal)."""
        callbacks, self._done = self._done, []
        for callback in callbacks:
            callback(self)


class _ResultMessages:
    """A result stream's messages, handed from the connection's thread to the handler on the
    loop, at most :data:`RESULT_WINDOW` ahead of it (flow control, as gRPC's window)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._room = threading.Semaphore(RESULT_WINDOW)
        self.closed = threading.Event()  # the handler is done: later messages are read and dropped

    # called on the connection's thread
    def put(self, item: ReceivedChunk | BaseException | None) -> None:
        while not self.closed.is_set():
            if self._room.acquire(timeout=0.5):
                try:
                    self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
                except RuntimeError:  # the loop closed: the server stopped, the call is over
                    self.closed.set()
                return

    # used on the loop
    async def __aiter__(self) -> AsyncIterator[ReceivedChunk]:
        while True:
            item = await self._queue.get()
            self._room.release()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class DataPort:
    """Listens on ``host:port`` (0: a free port, see :attr:`port`) for the data link's calls and
    answers them with ``service``'s handlers on ``loop``."""

    def __init__(self, service, loop: asyncio.AbstractEventLoop, security: ServerSecurity, host: str,
                 port: int, max_connections: int, result_chunk_bytes: int) -> None:
        self._service = service
        self._loop = loop
        self._tls = security.ssl_context()
        self._largest = largest_message(result_chunk_bytes)
        self._max_connections = max_connections
        self._connections: set[Connection] = set()  # shut by stop()
        self._calls: set[concurrent.futures.Future] = set()  # handlers running on the loop
        self._busy = 0  # connections in the middle of a call
        self._lock = threading.Condition()
        self._closing = False
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host.strip("[]"), port))
        except OSError:
            self._listener.close()
            raise
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="data-accept", daemon=True)
        self._acceptor.start()

    def stop(self, grace: float | None = None) -> None:
        """Stop listening; calls under way get ``grace`` seconds to end (the last polls carry the
        run's end to their processes), then every connection is closed and what still runs ends
        as cut."""
        shut(self._listener)  # wakes the accepting thread (closing alone does not)
        with self._lock:
            self._closing = True
            self._lock.wait_for(lambda: not self._busy, timeout=grace or 0.0)
            connections = list(self._connections)
            calls = list(self._calls)
        for connection in connections:
            shut(connection)
        for call in calls:
            call.cancel()
        self._acceptor.join(timeout=5.0)

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coroutine`` on the loop; :meth:`stop` cancels it if it still runs then."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        with self._lock:
            self._calls.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, call: concurrent.futures.Future) -> None:
        with self._lock:
            self._calls.discard(call)

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                if self._closing or len(self._connections) >= self._max_connections:
                    connection.close()
                    continue
                self._connections.add(connection)
            threading.Thread(target=self._serve, args=(connection,), name="data-link", daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        sock: Connection = raw  # what owns the connection: the TLS socket once wrapped, then the sealed one
        try:
            tune(raw)
            raw.settimeout(HEAD_SECONDS)
            common_name = None
            if self._tls is not None:
                tls = self._tls.wrap_socket(raw, server_side=True)
                self._track(raw, tls)
                sock = tls
                common_name = _common_name(tls)
                sock = seal(tls, server_side=True)
                self._track(tls, sock)
            idle = HEAD_SECONDS  # a process connects when it has a call to make
            while not self._closing:
                code = self._call(sock, common_name, idle)
                if code is None or code == grpc.StatusCode.UNAUTHENTICATED:
                    return
                idle = IDLE_SECONDS
        except (OSError, LinkBroken, ssl.SSLError, concurrent.futures.CancelledError):
            pass  # the connection is closed; a call it carried ended as cut
        finally:
            with self._lock:
                self._connections.discard(sock)
            shut(sock)

    def _track(self, old: Connection, new: Connection) -> None:
        """``new`` owns the connection that ``old`` did: stop() shuts it (at once if it already ran)."""
        with self._lock:
            self._connections.discard(old)
            self._connections.add(new)
            closing = self._closing
        if closing:
            shut(new)

    def _call(self, sock: Connection, common_name: str | None, idle: float) -> grpc.StatusCode | None:
        """Serve the next call, if one starts within ``idle`` seconds: its status (None: the
        connection ended)."""
        sock.settimeout(idle)
        first = sock.recv(1)
        if not first:
            return None
        with self._lock:
            self._busy += 1
        try:
            return self._serve_call(sock, first, common_name)
        finally:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()

    def _serve_call(self, sock: Connection, first: bytes, common_name: str | None) -> grpc.StatusCode:
        sock.settimeout(HEAD_SECONDS)
        magic, method, deadline_ms, token_length = CALL_HEAD.unpack(first + read_exactly(sock, CALL_HEAD.size - 1))
        if magic != MAGIC or method not in METHODS or token_length > MAX_TOKEN_BYTES:
            raise LinkBroken("not a data link call")
        token = bytes(read_exactly(sock, token_length)).decode(errors="replace")
        context = LinkContext(self._loop, token, common_name, deadline_ms)
        sock.settimeout(PROGRESS_SECONDS)
        if method == GET_TASK:
            request = bytes(read_exactly(sock, read_length(sock, self._largest)))
            if read_length(sock, self._largest) != 0:
                raise LinkBroken("a task request is one message")
            return self._get_task(sock, request, context)
        return self._submit_result(sock, context)

    # ------------------------------------------------------------------ the two calls

    def _get_task(self, sock: Connection, request_bytes: bytes, context: LinkContext) -> grpc.StatusCode:
        try:
            request = pb.TaskRequest.FromString(request_bytes)
        except Exception:  # noqa: BLE001 - any undecodable request is the caller's error
            send_status(sock, grpc.StatusCode.INTERNAL, "undecodable task request")
            return grpc.StatusCode.INTERNAL
        messages, code, details = self._on_loop(self._run_get_task(request, context)).result()
        for message in messages:
            send_frame(sock, MESSAGE, message)
        send_status(sock, code, details)
        return code

    async def _run_get_task(self, request: pb.TaskRequest, context: LinkContext
                            ) -> tuple[list[bytes], grpc.StatusCode, str]:
        messages: list[bytes] = []

        async def drain() -> None:
            async for chunk in self._service.GetTask(request, context):
                messages.append(chunk if isinstance(chunk, bytes) else chunk.SerializeToString())

        code, details = await _ended(drain(), context)
        return messages, code, details

    def _submit_result(self, sock: Connection, context: LinkContext) -> grpc.StatusCode:
        messages = _ResultMessages(self._loop)
        outcome = self._on_loop(self._run_submit_result(messages, context))
        try:
            while True:
                length = read_length(sock, self._largest)
                if not length:
                    messages.put(None)
                    break
                if context.time_remaining() == 0:
                    raise LinkBroken("the result stream outlasted its deadline")
                messages.put(read_chunk(pb.ResultHeader, read_exactly(sock, length)))
        except BaseException as error:
            messages.put(IncompleteMessage(f"the connection broke off ({error})"))
            outcome.result()
            raise
        reply, code, details = outcome.result()
        if reply is not None:
            send_frame(sock, MESSAGE, reply)
        send_status(sock, code, details)
        return code

    async def _run_submit_result(self, messages: _ResultMessages, context: LinkContext
                                 ) -> tuple[bytes | None, grpc.StatusCode, str]:
        reply: list[bytes] = []

        async def submit() -> None:
            reply.append((await self._service.SubmitResult(messages, context)).SerializeToString())

        try:
            code, details = await _ended(submit(), context)
        finally:
            messages.closed.set()
        return (reply[0] if reply else None), code, details


async def _ended(call, context: LinkContext) -> tuple[grpc.StatusCode, str]:
    """Run a handler to its end within the call's deadline: the status it ends with."""
    try:
        await asyncio.wait_for(call, context.time_remaining())
        return grpc.StatusCode.OK, ""
    except CallAborted as aborted:
        return aborted.code, aborted.details
    except asyncio.TimeoutError:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"
    except Exception as error:  # noqa: BLE001 - as gRPC does with a handler that raised
        return grpc.StatusCode.UNKNOWN, f"the server failed the call: {error}"
    finally:
        context.ended()


def _common_name(sock: ssl.SSLSocket) -> str | None:
    """The common name of a verified client certificate, if one was presented."""
    certificate = sock.getpeercert() or {}
    for entry in certificate.get("subject", ()):
        for key, value in entry:
            if key == "commonName":
                return value
    return None
