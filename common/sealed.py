"""A data port connection's bytes after its TLS handshake: sealed with AES-256-GCM in frames of up
to :data:`FRAME_BYTES`, under keys the two ends agreed inside that handshake's TLS session.

Why not TLS's own records: Python's ``ssl`` decrypts one TLS record (at most 16 KiB) per call and
reads each with two ``recv`` calls, so a 2.3 MB result costs about 140 interpreter round trips and
280 system calls on each side. That is most of what TLS adds to a transfer's CPU on the data port
(``benchmarks/transport_cost.py``: ssl-blocking against sealed), where the server and its client
processes share the cores with training (``benchmarks/round_overhead.py``). Sealed frames of up to
1 MiB are read with a few large ``recv_into`` calls and opened by one call into the caller's buffer.

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

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

HELLO = b"FPS1"
RANDOM_BYTES = 32
KEY_BYTES = 32                        # AES-256
TAG_BYTES = 16
FRAME_BYTES = 1 << 20                 # the most plaintext one frame seals
LENGTH = struct.Struct(">I")
SEALED_BYTES_LIMIT = 1 << 36          # per direction and connection
WORN_BYTES = SEALED_BYTES_LIMIT // 2  # a connection past this is not used for another call
_INFO = b"fedpart data port v1"


class SealBroken(ConnectionError):
    """The peer did not follow the protocol, a frame failed to open, or the stream ended."""


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
        self._out = bytearray(LENGTH.size + FRAME_BYTES + TAG_BYTES)
        self._in = bytearray(FRAME_BYTES + TAG_BYTES)
        self._pending = memoryview(bytearray(FRAME_BYTES))  # plaintext opened but not yet read
        self._pending_start = self._pending_end = 0
        self._head = b""  # the frame being opened: its length, as sent

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
        out = memoryview(self._out)
        for start in range(0, len(view), FRAME_BYTES):
            piece = view[start:start + FRAME_BYTES]
            if self.sealed_bytes + len(piece) > SEALED_BYTES_LIMIT:
                raise SealBroken("the connection sealed all it may under one key; a new one is needed")
            head = LENGTH.pack(len(piece))
            out[:LENGTH.size] = head
            end = LENGTH.size + len(piece) + TAG_BYTES
            self._send.encrypt_into(self._nonce(self._sent_frames), piece, head, out[LENGTH.size:end])
            self._sent_frames += 1
            self.sealed_bytes += len(piece)
            self._raw.sendall(out[:end])

    def recv_into(self, buffer: bytearray | memoryview, nbytes: int = 0) -> int:
        """Opened bytes into ``buffer`` (at most ``nbytes`` if given): how many; 0 when the peer
        closed the connection between frames."""
        target = memoryview(buffer).cast("B")
        wanted = min(nbytes or len(target), len(target))
        if not wanted:
            return 0
        if self._pending_start == self._pending_end:
            size = self._next_frame()
            if size is None:
                return 0
            if size <= wanted:  # the whole frame fits: open it straight into the caller's buffer
                self._open(size, target[:size])
                return size
            self._open(size, self._pending[:size])
            self._pending_start, self._pending_end = 0, size
        count = min(wanted, self._pending_end - self._pending_start)
        target[:count] = self._pending[self._pending_start:self._pending_start + count]
        self._pending_start += count
        return count

    def recv(self, count: int) -> bytes:
        buffer = bytearray(count)
        return bytes(buffer[:self.recv_into(buffer)])

    # ------------------------------------------------------------------ frames

    @staticmethod
    def _nonce(number: int) -> bytes:
        return number.to_bytes(12, "big")

    def _next_frame(self) -> int | None:
        """Read the next frame's length and sealed bytes (None: the stream ended before it)."""
        head = bytearray(LENGTH.size)
        got = self._raw.recv_into(head)
        if not got:
            return None
        if got < LENGTH.size:
            self._fill(memoryview(head)[got:])
        (size,) = LENGTH.unpack(head)
        if not 0 < size <= FRAME_BYTES:
            raise SealBroken(f"a frame of {size} bytes is announced; 1 to {FRAME_BYTES} are sealed")
        self._head = bytes(head)
        self._fill(memoryview(self._in)[:size + TAG_BYTES])
        return size

    def _fill(self, view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            got = self._raw.recv_into(view[filled:])
            if not got:
                raise SealBroken("the connection ended in the middle of a frame")
            filled += got

    def _open(self, size: int, into: memoryview) -> None:
        try:
            self._receive.decrypt_into(self._nonce(self._received_frames),
                                       memoryview(self._in)[:size + TAG_BYTES], self._head, into)
        except InvalidTag:
            raise SealBroken("a frame failed to open: changed, injected, replayed or out of order") from None
        self._received_frames += 1
        self.opened_bytes += size


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
    raw = tls.unwrap()
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
