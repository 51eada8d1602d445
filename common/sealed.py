"""A data port connection's bytes after its TLS handshake: sealed with AES-256-GCM in frames of up
to :data:`FRAME_BYTES`, under keys the two ends agreed inside that handshake's TLS session.

Why not TLS's own records: Python's ``ssl`` decrypts one TLS record (at most 16 KiB) per call and
reads each with two ``recv`` calls, so a 2.3 MB result costs about 140 interpreter round trips and
280 system calls on each side. That is most of what TLS adds to a transfer's CPU on the data port
(``benchmarks/transport_cost.py``: ssl-blocking against sealed), where the server and its client
processes share the cores with training (``benchmarks/round_overhead.py``). A sealed frame holds a
whole message of up to 1 MiB and its fields; it is read with a few large ``recv_into`` calls and
opened by one call, into the caller's buffer when it fits there.

The protocol (:func:`seal`), once the TLS handshake has verified the certificates:

1. inside TLS, the client sends ``HELLO`` and 32 random bytes, then the server the same;
2. both ends shut TLS down (``close_notify`` each way, :meth:`ssl.SSLSocket.unwrap`) and go on over
   the same TCP connection;
3. HKDF-SHA256 over the client's then the server's random bytes gives one key per direction;
4. each frame is ``length (u32, big-endian) | ciphertext | tag (16 bytes)``: the plaintext's
   length, authenticated as the frame's associated data, and the plaintext sealed under the
   direction's key with the frame's number (counted from 0 in each direction) as its nonce.

What TLS's record layer guarantees holds for the frames: only the two ends know the keys (their
random bytes crossed inside the verified TLS session), a frame changed, injected, dropped,
replayed or reordered fails to open at the next frame the receiver expects (its number is the
nonce), and a nonce is never used twice under one key (one key per direction, frame numbers only
go up). A connection seals at most :data:`SEALED_BYTES_LIMIT` bytes in each direction, well
inside AES-GCM's bounds for one key (RFC 8446, section 5.5); the client's pool closes a
connection past :data:`WORN_BYTES` so that the limit is never reached by a working connection. A
stream cut between frames ends as a broken connection, as a TLS connection cut without
``close_notify`` does: the calls' own framing says whether a call was complete.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

HELLO = b"FPS1"
RANDOM_BYTES = 32
KEY_BYTES = 32                        # AES-256
TAG_BYTES = 16
FRAME_BYTES = (1 << 20) + (1 << 16)   # the most plaintext one frame seals: a 1 MiB message and its fields
LENGTH = struct.Struct(">I")
SEALED_BYTES_LIMIT = 1 << 36          # per direction and connection
WORN_BYTES = SEALED_BYTES_LIMIT // 2  # a connection past this is not used for another call
KEPT_BUFFERS = 4                      # frame buffers a process keeps between frames
SMALL_FRAME = 64 << 10                # frames up to this size are sealed and opened in buffers of their own size
_INFO = b"fedpart data port v1"


class SealBroken(ConnectionError):
    """The peer did not follow the protocol, a frame failed to open, or the stream ended."""


class _FrameBuffers:
    """Buffers for one sealed frame each, shared by a process's connections: a frame larger than
    :data:`SMALL_FRAME` borrows one while it is sealed and sent or read and opened, so an idle
    connection holds none, and at most :data:`KEPT_BUFFERS` wait between frames."""

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(LENGTH.size + FRAME_BYTES + TAG_BYTES)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            if len(self._free) < KEPT_BUFFERS:
                self._free.append(buffer)


_buffers = _FrameBuffers()


class SealedSocket:
    """A connected socket whose bytes go in sealed frames: the blocking socket calls the data
    port uses (``sendall``, ``recv_into``, ``recv``, ``settimeout``, ``shutdown``, ``close``).
    One thread at a time sends and one receives; :meth:`shutdown` may come from any thread."""

    def __init__(self, raw: socket.socket, send_key: bytes, receive_key: bytes) -> None:
        self._raw = raw
        self._send = AESGCM(send_key)
        self._receive = AESGCM(receive_key)
        self._sent_frames = self._received_frames = 0
        self.sealed_bytes = self.opened_bytes = 0
        self._pending = memoryview(b"")  # opened bytes of the last frame not read yet

    @property
    def worn(self) -> bool:
        """Whether the connection has carried enough that it should not take another call."""
        return max(self.sealed_bytes, self.opened_bytes) >= WORN_BYTES

    # ------------------------------------------------------------------ socket calls

    def settimeout(self, seconds: float | None) -> None:
        self._raw.settimeout(seconds)

    def shutdown(self, how: int) -> None:
        self._raw.shutdown(how)

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> SealedSocket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """Seal ``data`` into as many frames as it takes and send them."""
        view = memoryview(data).cast("B")
        if len(view) <= SMALL_FRAME:  # the call heads, lengths and statuses: no frame buffer
            if view:
                head, nonce = self._number(len(view))
                self._raw.sendall(head + self._send.encrypt(nonce, view, head))
            return
        buffer = _buffers.take()
        try:
            out = memoryview(buffer)
            for start in range(0, len(view), FRAME_BYTES):
                piece = view[start:start + FRAME_BYTES]
                head, nonce = self._number(len(piece))
                out[:LENGTH.size] = head
                end = LENGTH.size + len(piece) + TAG_BYTES
                self._send.encrypt_into(nonce, piece, head, out[LENGTH.size:end])
                self._raw.sendall(out[:end])
        finally:
            _buffers.give(buffer)

    def _number(self, size: int) -> tuple[bytes, bytes]:
        """The head and nonce of the next frame sent, of ``size`` bytes (within the limit)."""
        if self.sealed_bytes + size > SEALED_BYTES_LIMIT:
            raise SealBroken("the connection sealed all it may under one key; a new one is needed")
        nonce = self._nonce(self._sent_frames)
        self._sent_frames += 1
        self.sealed_bytes += size
        return LENGTH.pack(size), nonce

    def recv_into(self, buffer: bytearray | memoryview, nbytes: int = 0) -> int:
        """Opened bytes into ``buffer`` (at most ``nbytes`` if given): how many; 0 when the peer
        closed the connection between frames."""
        target = memoryview(buffer).cast("B")
        wanted = min(nbytes or len(target), len(target))
        if not wanted:
            return 0
        if not self._pending:
            opened = self._next_frame(target[:wanted])
            if opened is None:
                return 0
            if isinstance(opened, int):
                return opened
            self._pending = opened
        count = min(wanted, len(self._pending))
        target[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def recv(self, count: int) -> bytes:
        buffer = bytearray(count)
        return bytes(buffer[:self.recv_into(buffer)])

    # ------------------------------------------------------------------ frames

    @staticmethod
    def _nonce(number: int) -> bytes:
        return number.to_bytes(12, "big")

    def _next_frame(self, target: memoryview) -> int | memoryview | None:
        """Read and open the next frame: into ``target`` if it fits (how many bytes), else into
        bytes of its own (returned); None when the stream ended before it."""
        length = bytearray(LENGTH.size)
        got = self._raw.recv_into(length)
        if not got:
            return None
        if got < LENGTH.size:
            self._fill(memoryview(length)[got:])
        head = bytes(length)  # the frame's associated data
        (size,) = LENGTH.unpack(head)
        if not 0 < size <= FRAME_BYTES:
            raise SealBroken(f"a frame of {size} bytes is announced; 1 to {FRAME_BYTES} are sealed")
        pooled = size > SMALL_FRAME
        buffer = _buffers.take() if pooled else bytearray(size + TAG_BYTES)
        try:
            sealed = memoryview(buffer)[:size + TAG_BYTES]
            self._fill(sealed)
            nonce = self._nonce(self._received_frames)
            try:
                if size <= len(target):  # the whole frame fits: opened straight into the caller's buffer
                    self._receive.decrypt_into(nonce, sealed, head, target[:size])
                    opened: int | memoryview = size
                else:
                    opened = memoryview(self._receive.decrypt(nonce, sealed, head))
            except InvalidTag:
                raise SealBroken("a frame failed to open: changed, injected, replayed or out of order") from None
        finally:
            if pooled:
                _buffers.give(buffer)
        self._received_frames += 1
        self.opened_bytes += size
        return opened

    def _fill(self, view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            got = self._raw.recv_into(view[filled:])
            if not got:
                raise SealBroken("the connection ended in the middle of a frame")
            filled += got


def seal(tls: ssl.SSLSocket, server_side: bool) -> SealedSocket:
    """Agree the keys inside ``tls`` (its handshake done), shut TLS down and return the TCP
    connection under sealed frames (the module's protocol). ``tls``'s timeout bounds each step."""
    mine = os.urandom(RANDOM_BYTES)
    if server_side:
        theirs = _hello(tls)
        tls.sendall(HELLO + mine)
        client_random, server_random = theirs, mine
    else:
        tls.sendall(HELLO + mine)
        theirs = _hello(tls)
        client_random, server_random = mine, theirs
    keys = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=None,
                info=_INFO).derive(client_random + server_random)
    to_server, to_client = keys[:KEY_BYTES], keys[KEY_BYTES:]
    timeout = tls.gettimeout()
    tls.unwrap()
    raw = socket.socket(tls.family, tls.type, tls.proto, fileno=tls.detach())  # the bare TCP socket
    raw.settimeout(timeout)
    return SealedSocket(raw, *((to_client, to_server) if server_side else (to_server, to_client)))


def _hello(tls: ssl.SSLSocket) -> bytes:
    """The peer's hello: its random bytes."""
    expected = len(HELLO) + RANDOM_BYTES
    message = bytearray()
    while len(message) < expected:
        got = tls.recv(expected - len(message))
        if not got:
            raise SealBroken("the connection ended before the peer's hello")
        message += got
    if not message.startswith(HELLO):
        raise SealBroken("the peer did not start the data port's sealing")
    return bytes(message[len(HELLO):])
