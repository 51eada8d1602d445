"""The data port's framing: the task and result streams of ``proto/fedpart.proto`` over a TLS
connection of their own, beside gRPC (its bytes sealed under keys agreed in the TLS handshake,
:mod:`fedpart.common.sealed`).

Why it exists: moving a model through gRPC's asyncio API over TLS costs about four times the CPU
of the same bytes over this link (``benchmarks/transport_cost.py``: 12.5 against 2.8-3.0 ms of CPU
per 2.3 MB result, sender and receiver together, where an ``ssl`` socket's TLS records cost 4.5-4.9
ms). Where the server and its client processes share the cores (``fedpart run``), that CPU is the
round's excess over the compute floor (``benchmarks/round_overhead.py``, docs/benchmarks.md).

What travels are the very messages of the ``GetTask`` and ``SubmitResult`` calls, and the server
answers them with the same code as gRPC's (:mod:`fedpart.server.data_port`), so validation,
at-least-once delivery, refusals and the byte ledger do not depend on the path. A connection
carries one call at a time; once a call is answered the connection takes the next.

A call, client to server::

    MAGIC | method (u8) | deadline in ms (u32) | token length (u16) | token (utf-8)
    then the request's messages, each: length (u32) | message; a zero length ends them

``GetTask`` sends one message (its ``TaskRequest``); ``SubmitResult`` its serialized result
chunks. The server answers with frames, each ``kind (u8) | length (u32) | body``: the response
messages (:data:`MESSAGE`), then one :data:`STATUS` whose body is a gRPC status code (u8) and its
details (utf-8). All integers are big-endian.
"""

from __future__ import annotations

import socket
import struct

import grpc

from fedpart.common.protocol import KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT_SECONDS
from fedpart.common.sealed import SealedSocket
from fedpart.common.wire import empty_bytes

MAGIC = b"FPD1"
GET_TASK = 1
SUBMIT_RESULT = 2
METHODS = {GET_TASK: "GetTask", SUBMIT_RESULT: "SubmitResult"}

CALL_HEAD = struct.Struct(">4sBIH")  # magic, method, deadline ms, token length
LENGTH = struct.Struct(">I")
FRAME = struct.Struct(">BI")         # kind, body length
MESSAGE = 1
STATUS = 2

SMALL_MESSAGE = 64 << 10  # messages up to this size are joined to their prefix before sending
PROGRESS_SECONDS = KEEPALIVE_SECONDS + KEEPALIVE_TIMEOUT_SECONDS  # longest wait for a call's next bytes
MAX_TOKEN_BYTES = 4096
MAX_DETAILS_BYTES = 64 << 10
GRPC_MAX_MESSAGE = 4 << 20  # gRPC's default limit on a received message, which the calls keep


Connection = socket.socket | SealedSocket  # sealed with TLS (fedpart.common.sealed), else plain


class LinkBroken(ConnectionError):
    """The connection ended or sent bytes that are not a call: it is closed."""


def largest_message(result_chunk_bytes: int) -> int:
    """The longest message a call may announce: what gRPC would take, or a configured result
    message size above it, with room for the message's own fields."""
    return max(GRPC_MAX_MESSAGE, result_chunk_bytes + (64 << 10))


def read_exactly(sock: Connection, count: int) -> memoryview:
    """``count`` bytes from ``sock`` (blocking, within its timeout), read into a buffer that is
    not zeroed first; :class:`LinkBroken` if the connection ends first."""
    view = empty_bytes(count)
    filled = 0
    while filled < count:
        got = sock.recv_into(view[filled:])
        if not got:
            raise LinkBroken(f"the connection ended after {filled} of {count} bytes")
        filled += got
    return view


def read_length(sock: Connection, largest: int) -> int:
    """A message length, at most ``largest``."""
    (length,) = LENGTH.unpack(read_exactly(sock, LENGTH.size))
    if length > largest:
        raise LinkBroken(f"a message of {length} bytes is announced; at most {largest} are taken")
    return length


def send_prefixed(sock: Connection, prefix: bytes, body: bytes) -> None:
    """``prefix`` then ``body``, without copying a large body to join them."""
    if len(body) <= SMALL_MESSAGE:
        sock.sendall(prefix + body)
    else:
        sock.sendall(prefix)
        sock.sendall(body)


def send_frame(sock: Connection, kind: int, body: bytes) -> None:
    """One frame of the server's answer."""
    send_prefixed(sock, FRAME.pack(kind, len(body)), body)


def send_status(sock: Connection, code: grpc.StatusCode, details: str) -> None:
    """The frame that ends the server's answer to a call."""
    send_frame(sock, STATUS, bytes([code.value[0]]) + details.encode()[:MAX_DETAILS_BYTES])


def tune(sock: socket.socket) -> None:
    """No Nagle delay for a call's small frames, and TCP keepalive on gRPC's schedule
    (:mod:`fedpart.common.protocol`), so that a connection whose peer vanished is found while a
    call waits on it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probes = KEEPALIVE_TIMEOUT_SECONDS // KEEPALIVE_SECONDS
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_SECONDS), ("TCP_KEEPINTVL", KEEPALIVE_SECONDS),
                          ("TCP_KEEPCNT", probes)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), max(1, int(value)))


def shut(sock: Connection) -> None:
    """Close ``sock`` at once, waking a thread blocked on it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
