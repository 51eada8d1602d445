"""Sealed frames (``common/sealed.py``): what a data port connection carries after its TLS
handshake. The frames' peer here is written from the module's description of the protocol with
``cryptography``'s primitives (not with :class:`SealedSocket`), so the tests check the protocol as
documented: a changed, injected, replayed, reordered or cut frame ends the connection as broken."""

from __future__ import annotations

import os
import socket
import ssl
import struct
import threading

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedpart.common import sealed
from fedpart.common.sealed import FRAME_BYTES, SealBroken, SealedSocket, seal
from fedpart.deploy.certs import write_run_credentials

BOUND = 30.0  # seconds: no step here should come near it, even on a busy machine
KEY_TO_PEER, KEY_TO_US = os.urandom(32), os.urandom(32)


class Peer:
    """The other end of a sealed connection, by the protocol's description: each frame is
    ``length (u32) | AES-256-GCM(plaintext, nonce = frame number, associated data = length)``.
    Also a socket for tests that speak to the data port: ``sendall`` and ``recv``."""

    def __init__(self, raw: socket.socket, send_key: bytes, receive_key: bytes) -> None:
        self.raw, self.send_key, self.receive_key = raw, AESGCM(send_key), AESGCM(receive_key)
        self.sent = self.received = 0
        self.pending = b""

    def frame(self, plaintext: bytes, number: int | None = None) -> bytes:
        """A sealed frame (numbered as the next one unless ``number`` is given)."""
        head = struct.pack(">I", len(plaintext))
        nonce = (self.sent if number is None else number).to_bytes(12, "big")
        if number is None:
            self.sent += 1
        return head + self.send_key.encrypt(nonce, plaintext, head)

    def send(self, plaintext: bytes) -> None:
        self.raw.sendall(self.frame(plaintext))

    def receive(self) -> bytes:
        """The next frame's plaintext (empty: the connection ended before it)."""
        first = self.raw.recv(1)
        if not first:
            return b""
        head = first + _read(self.raw, 3)
        (length,) = struct.unpack(">I", head)
        body = _read(self.raw, length + 16)
        plaintext = self.receive_key.decrypt(self.received.to_bytes(12, "big"), body, head)
        self.received += 1
        return plaintext

    def sendall(self, data: bytes) -> None:
        for start in range(0, len(data), FRAME_BYTES):
            self.send(data[start:start + FRAME_BYTES])

    def recv(self, count: int) -> bytes:
        if not self.pending:
            self.pending = self.receive()
        taken, self.pending = self.pending[:count], self.pending[count:]
        return taken

    def settimeout(self, seconds: float | None) -> None:
        self.raw.settimeout(seconds)

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def sealed_as_described(tls: ssl.SSLSocket) -> Peer:
    """The client's side of :func:`seal`, from its description: HELLO and 32 random bytes each way
    inside TLS, TLS shut down, HKDF-SHA256 over the client's then the server's bytes, the first
    32 bytes of key material for the client's frames."""
    mine = os.urandom(32)
    tls.sendall(b"FPS1" + mine)
    hello = _read(tls, 36)
    assert hello[:4] == b"FPS1"
    keys = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=b"fedpart data port v1").derive(mine + hello[4:])
    return Peer(tls.unwrap(), send_key=keys[:32], receive_key=keys[32:])


def _read(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        got = sock.recv(count - len(data))
        assert got, f"closed after {len(data)} of {count} bytes"
        data += got
    return data


@pytest.fixture
def pair():
    """A :class:`SealedSocket` and its :class:`Peer` over a socket pair, with known keys."""
    ours, theirs = socket.socketpair()
    ours.settimeout(BOUND)
    theirs.settimeout(BOUND)
    yield SealedSocket(ours, KEY_TO_PEER, KEY_TO_US), Peer(theirs, KEY_TO_US, KEY_TO_PEER)
    ours.close()
    theirs.close()


def _received(sock: SealedSocket, count: int, piece: int) -> bytes:
    """``count`` bytes read ``piece`` at a time."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    filled = 0
    while filled < count:
        got = sock.recv_into(view[filled:filled + piece])
        assert got
        filled += got
    return bytes(buffer)


@pytest.mark.parametrize("size", [1, 5, FRAME_BYTES, FRAME_BYTES + 1, 2_328_104])
def test_what_is_sealed_opens_at_the_peer_frame_by_frame(pair, size) -> None:
    sock, peer = pair
    data = os.urandom(size)
    sender = threading.Thread(target=sock.sendall, args=(data,))
    sender.start()
    frames = [peer.receive() for _ in range(-(-size // FRAME_BYTES))]
    sender.join(BOUND)
    assert b"".join(frames) == data
    assert all(0 < len(frame) <= FRAME_BYTES for frame in frames)
    assert sock.sealed_bytes == size


@pytest.mark.parametrize("piece", [7, 4096, 3 << 20], ids=["7-bytes", "4-KiB", "more-than-sent"])
def test_what_the_peer_seals_is_read_whole_in_pieces_of_any_size(pair, piece) -> None:
    sock, peer = pair
    frames = [os.urandom(n) for n in (3, FRAME_BYTES, 70_000)]
    sender = threading.Thread(target=lambda: [peer.send(frame) for frame in frames])
    sender.start()
    expected = b"".join(frames)
    assert _received(sock, len(expected), piece) == expected
    sender.join(BOUND)
    assert sock.opened_bytes == len(expected)


def test_sending_nothing_sends_no_frame(pair) -> None:
    sock, peer = pair
    sock.sendall(b"")
    sock.sendall(b"k")
    assert peer.receive() == b"k"


def test_a_close_between_frames_reads_as_the_end(pair) -> None:
    sock, peer = pair
    peer.send(b"last")
    peer.raw.shutdown(socket.SHUT_WR)
    assert sock.recv(10) == b"last"
    assert sock.recv(10) == b""


def _tampered(frame: bytes) -> bytes:
    changed = bytearray(frame)
    changed[len(changed) // 2] ^= 1
    return bytes(changed)


@pytest.mark.parametrize("fault", ["changed", "length-changed", "injected", "replayed", "reordered", "cut",
                                   "over-long", "empty"])
def test_a_frame_that_is_not_the_next_one_sealed_breaks_the_connection(pair, fault) -> None:
    sock, peer = pair
    first = peer.frame(b"first message")
    second = peer.frame(b"second message")
    wire = {
        "changed": first[:4] + _tampered(first[4:]),
        "length-changed": struct.pack(">I", 12) + first[4:],
        "injected": struct.pack(">I", 5) + b"hello" + bytes(16),
        "replayed": first + first,
        "reordered": second + first,
        "cut": first[:-3],
        "over-long": struct.pack(">I", FRAME_BYTES + 1),
        "empty": struct.pack(">I", 0) + bytes(16),
    }[fault]
    peer.raw.sendall(wire)
    if fault == "cut":
        peer.raw.shutdown(socket.SHUT_WR)
    with pytest.raises(SealBroken):
        while sock.recv(100):  # the replayed frame opens once, then fails
            pass


def test_a_connection_seals_no_more_than_its_limit_and_wears_out_before(pair, monkeypatch) -> None:
    sock, peer = pair
    monkeypatch.setattr(sealed, "SEALED_BYTES_LIMIT", 100)
    monkeypatch.setattr(sealed, "WORN_BYTES", 50)
    sock.sendall(bytes(50))
    assert peer.receive() == bytes(50)
    assert sock.worn
    with pytest.raises(SealBroken):
        sock.sendall(bytes(51))


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    secrets = tmp_path_factory.mktemp("secrets")
    write_run_credentials(secrets, ["127.0.0.1"], clients=1, processes=1)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(secrets / "server.pem", secrets / "server.key")
    client = ssl.create_default_context(cafile=secrets / "ca.pem")
    return server, client


def _tls_pair(credentials) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
    """Both ends of a TLS connection on 127.0.0.1: the client's and the server's."""
    server_context, client_context = credentials
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client_raw = socket.create_connection(listener.getsockname()[:2], timeout=BOUND)
        server_raw, _ = listener.accept()
    server_raw.settimeout(BOUND)
    server: list[ssl.SSLSocket] = []
    handshake = threading.Thread(target=lambda: server.append(server_context.wrap_socket(server_raw, server_side=True)))
    handshake.start()
    client = client_context.wrap_socket(client_raw, server_hostname="127.0.0.1")
    handshake.join(BOUND)
    return client, server[0]


def test_seal_agrees_one_key_per_direction_inside_tls_as_described(credentials) -> None:
    """Our server end against a client that follows the description."""
    client, server_tls = _tls_pair(credentials)
    ends: list[SealedSocket] = []
    sealing = threading.Thread(target=lambda: ends.append(seal(server_tls, server_side=True)))
    sealing.start()
    with sealed_as_described(client) as peer:
        sealing.join(BOUND)
        with ends[0] as server:
            peer.send(b"to the server")
            assert server.recv(100) == b"to the server"
            server.sendall(b"to the client")
            assert peer.receive() == b"to the client"


def test_both_ends_of_seal_talk_and_a_wrong_hello_is_refused(credentials) -> None:
    client, server_tls = _tls_pair(credentials)
    ends: list[SealedSocket] = []
    sealing = threading.Thread(target=lambda: ends.append(seal(server_tls, server_side=True)))
    sealing.start()
    ours = seal(client, server_side=False)
    sealing.join(BOUND)
    data = os.urandom(3 << 20)
    sender = threading.Thread(target=ours.sendall, args=(data,))
    sender.start()
    assert _received(ends[0], len(data), 1 << 16) == data
    sender.join(BOUND)
    ours.close()
    ends[0].close()

    client, server_tls = _tls_pair(credentials)
    failures: list[BaseException] = []

    def server_side() -> None:
        try:
            seal(server_tls, server_side=True)
        except SealBroken as error:
            failures.append(error)
        finally:
            server_tls.close()

    sealing = threading.Thread(target=server_side)
    sealing.start()
    client.sendall(b"FPD1" + bytes(32))  # a call's head where the hello belongs
    sealing.join(BOUND)
    assert failures and "did not start" in str(failures[0])
    client.close()


def test_idle_connections_hold_no_frame_buffer_and_few_wait_between_frames() -> None:
    """Frame buffers are borrowed per frame from one pool: an idle sealed connection holds none,
    and the pool keeps at most ``KEPT_BUFFERS`` between frames."""
    pairs = [socket.socketpair() for _ in range(8)]
    try:
        ends = [(SealedSocket(ours, KEY_TO_PEER, KEY_TO_US), Peer(theirs, KEY_TO_US, KEY_TO_PEER))
                for ours, theirs in pairs]
        for sock, peer in ends:
            peer.send(b"x" * 1000)
            assert sock.recv(1000) == b"x" * 1000
            sock.sendall(b"y" * 1000)
            assert peer.receive() == b"y" * 1000
        assert len(sealed._buffers._free) <= sealed.KEPT_BUFFERS
        assert all(not vars(sock).get("_pending") for sock, _ in ends)
        assert not any(isinstance(value, bytearray) for sock, _ in ends for value in vars(sock).values())
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_small_frames_take_no_pooled_buffer(pair, monkeypatch) -> None:
    """A call's head, a length or a status (up to ``SMALL_FRAME``) is sealed and opened in a
    buffer of its own size, never one of the pool's 1 MiB buffers."""
    sock, peer = pair
    taken: list[bytearray] = []
    original = sealed._buffers.take
    monkeypatch.setattr(sealed._buffers, "take", lambda: taken.append(original()) or taken[-1])
    sock.sendall(b"s" * sealed.SMALL_FRAME)
    assert peer.receive() == b"s" * sealed.SMALL_FRAME
    peer.send(b"r" * 5)
    assert sock.recv(5) == b"r" * 5
    assert not taken
    sock.sendall(b"b" * (sealed.SMALL_FRAME + 1))  # the counter counts: a larger frame takes one
    assert len(taken) == 1
