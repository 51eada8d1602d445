"""The data port (``common/data_link.py``, ``server/data_port.py``): tasks and results over TLS
connections of their own, answered by gRPC's handlers. Hostile clients here are TLS sockets
written against the framing and the sealing (test_sealed.py's :class:`Peer`, not fedpart's
client), with real certificates and tokens made in the test; the whole path with fedpart's client
is in test_faults.py and test_end_to_end.py."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import time

import grpc
import pytest
import torch

from fedpart.client.data_link import DataLink
from fedpart.common.data_link import CALL_HEAD, FRAME, GET_TASK, LENGTH, MAGIC, MESSAGE, STATUS, SUBMIT_RESULT
from fedpart.common.security import ClientSecurity
from fedpart.common.wire import decode_chunks
from fedpart.proto import fedpart_pb2 as pb
from fedpart.server.data_port import HEAD_SECONDS
from fedpart.deploy.certs import write_run_credentials
from test_sealed import Peer, sealed_as_described
from test_security import BOUND, SecureHarness, _join, _ready, _Recorder, _result

_CODES = {code.value[0]: code for code in grpc.StatusCode}


@pytest.fixture
def harness(tmp_path):
    """Makes in-process servers with TLS, credentials (processes 0 and 1) and a data port."""
    secrets = tmp_path / "secrets"
    write_run_credentials(secrets, ["127.0.0.1", "localhost"], clients=4, processes=2)
    made: list[SecureHarness] = []

    def make(**overrides) -> SecureHarness:
        made.append(SecureHarness(secrets, data_port=0, **overrides))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _data_port(harness: SecureHarness) -> tuple[str, int]:
    host, _, port = harness.server.data_address.rpartition(":")
    return host, int(port)


def _dial(harness: SecureHarness, layer: str = "sealed") -> socket.socket | ssl.SSLSocket | Peer:
    """A connection to the data port: plaintext, TLS only, or sealed as the protocol describes."""
    raw = socket.create_connection(_data_port(harness), timeout=BOUND)
    if layer == "plaintext":
        return raw
    context = ssl.create_default_context(cadata=(harness.secrets / "ca.pem").read_text())
    tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
    return tls if layer == "tls" else sealed_as_described(tls)


def _token(harness: SecureHarness, process: int = 0) -> bytes:
    return (harness.secrets / f"process_{process}.token").read_bytes().strip()


def _send_call(sock: socket.socket, method: int, token: bytes, messages: list[bytes],
               deadline_ms: int = int(BOUND * 1000), end: bool = True) -> None:
    sock.sendall(CALL_HEAD.pack(MAGIC, method, deadline_ms, len(token)) + token)
    for message in messages:
        sock.sendall(LENGTH.pack(len(message)) + message)
    if end:
        sock.sendall(LENGTH.pack(0))


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        got = sock.recv(count - len(data))
        if not got:
            raise ConnectionError(f"closed after {len(data)} of {count} bytes")
        data += got
    return data


def _answer(sock: socket.socket) -> tuple[list[bytes], grpc.StatusCode, str]:
    messages = []
    while True:
        kind, length = FRAME.unpack(_read_exactly(sock, FRAME.size))
        body = _read_exactly(sock, length)
        if kind == STATUS:
            return messages, _CODES[body[0]], body[1:].decode()
        assert kind == MESSAGE
        messages.append(body)


def _call(sock: socket.socket, method: int, token: bytes, messages: list[bytes], **options):
    _send_call(sock, method, token, messages, **options)
    return _answer(sock)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (within the bound)."""
    sock.settimeout(BOUND)
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def _train_task_by_data_port(harness: SecureHarness, sock: socket.socket):
    """Join by gRPC (the reply names the data port), then long-poll the training task by the data port."""
    stub = harness.stub(0)
    reply = _join(stub, [0, 1])
    assert reply.data_port == _data_port(harness)[1]
    other = harness.stub(1)
    _ready(other, _join(other, [2, 3]).session)
    harness.start_round()
    request = pb.TaskRequest(session=reply.session, wait_seconds=BOUND / 2).SerializeToString()
    while True:
        messages, code, details = _call(sock, GET_TASK, _token(harness), [request])
        assert code == grpc.StatusCode.OK, details
        header, _ = decode_chunks(pb.TaskChunk.FromString(m) for m in messages)
        if header.kind != pb.IDLE:
            break
    uploads = {n: torch.full_like(harness.coordinator.global_state[n], 0.5) for n in header.train.upload_deltas}
    chunks = [chunk.SerializeToString() for chunk in _result(reply.session, header, uploads)]
    return stub, reply.session, header, uploads, chunks


def test_a_round_by_the_data_port_folds_and_counts_what_grpc_would(harness) -> None:
    """A task and its result by the data port: the result is folded, and the ledger counts the
    bytes that the same calls by gRPC count (the round's record does not depend on the path)."""
    by_port = harness()
    with _dial(by_port) as sock:
        _, _, _, uploads, chunks = _train_task_by_data_port(by_port, sock)
        messages, code, details = _call(sock, SUBMIT_RESULT, _token(by_port), chunks)
    assert code == grpc.StatusCode.OK, details
    assert pb.SubmitReply.FromString(messages[0]).accepted
    by_grpc = harness()
    stub = by_grpc.stub(0)
    session = _join(stub, [0, 1]).session
    other = by_grpc.stub(1)
    _ready(other, _join(other, [2, 3]).session)
    by_grpc.start_round()
    while True:
        header, _ = decode_chunks(stub.GetTask(pb.TaskRequest(session=session, wait_seconds=BOUND / 2), timeout=BOUND))
        if header.kind != pb.IDLE:
            break
    assert stub.SubmitResult(iter(_result(session, header, uploads)), timeout=BOUND).accepted
    deadline = time.monotonic() + BOUND
    while by_port.coordinator.ledger.totals(1)["up"] != by_grpc.coordinator.ledger.totals(1)["up"]:
        assert time.monotonic() < deadline, (by_port.coordinator.ledger.totals(1), by_grpc.coordinator.ledger.totals(1))
        time.sleep(0.05)
    assert by_port.coordinator.ledger.totals(1) == by_grpc.coordinator.ledger.totals(1)


def test_calls_without_a_known_credential_or_a_deadline_are_refused(harness) -> None:
    server = harness()
    request = pb.TaskRequest(session="none", wait_seconds=0).SerializeToString()
    for token in (b"forged", b""):
        with _dial(server) as sock:
            assert _call(sock, GET_TASK, token, [request])[1] == grpc.StatusCode.UNAUTHENTICATED
            assert _closed(sock)  # a refused credential holds no connection
    with _dial(server) as sock:
        assert _call(sock, GET_TASK, _token(server), [request], deadline_ms=0)[1] == grpc.StatusCode.INVALID_ARGUMENT
        # the connection stays in step: a known token with an unknown session reaches the handler
        assert _call(sock, GET_TASK, _token(server), [request])[1] == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.1\r\n\r\n", CALL_HEAD.pack(MAGIC, 9, 1000, 0),
                                  CALL_HEAD.pack(MAGIC, GET_TASK, 1000, 0) + LENGTH.pack(1 << 30)],
                         ids=["not-a-call", "unknown-method", "message-over-the-bound"])
def test_bytes_that_are_no_call_close_the_connection_and_nothing_else(harness, junk) -> None:
    server = harness()
    with _dial(server) as sock:
        sock.sendall(junk)
        assert _closed(sock)
    request = pb.TaskRequest(session="none", wait_seconds=0).SerializeToString()
    with _dial(server) as sock:
        assert _call(sock, GET_TASK, _token(server), [request])[1] == grpc.StatusCode.NOT_FOUND


def test_plaintext_against_the_tls_data_port_gets_nothing(harness) -> None:
    server = harness()
    with _dial(server, layer="plaintext") as sock:
        try:
            _send_call(sock, GET_TASK, _token(server), [pb.TaskRequest(session="none").SerializeToString()])
        except ConnectionError:
            pass  # the server may close before the call is sent whole
        assert _closed(sock)


def test_a_refused_result_is_answered_and_the_connection_stays_in_step(harness) -> None:
    server = harness()
    with _dial(server) as sock:
        _, session, header, uploads, chunks = _train_task_by_data_port(server, sock)
        junk = pb.ResultChunk()
        junk.pieces.add(index=0, data=b"")
        stream = [chunks[0], junk.SerializeToString(), *chunks[1:]]
        _, code, details = _call(sock, SUBMIT_RESULT, _token(server), stream)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "must carry tensor bytes" in details
        # the refused task is dropped; the next call on the same connection is read from its first byte
        _, code, details = _call(sock, SUBMIT_RESULT, _token(server), chunks)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert server.coordinator.ledger.refused_bytes > 0
    assert all(torch.equal(server.initial[k], v) for k, v in server.coordinator.global_state.items())


def test_a_result_cut_off_mid_stream_leaves_its_task_open_for_the_next_attempt(harness) -> None:
    server = harness()
    with _dial(server) as sock:
        _, session, header, uploads, chunks = _train_task_by_data_port(server, sock)
        _send_call(sock, SUBMIT_RESULT, _token(server), chunks[:2], end=False)
    with _dial(server) as sock:
        messages, code, details = _call(sock, SUBMIT_RESULT, _token(server), chunks)
    assert code == grpc.StatusCode.OK, details
    assert pb.SubmitReply.FromString(messages[0]).accepted


@pytest.mark.parametrize("layer", ["tls", "sealed"], ids=["no-hello", "no-call"])
def test_a_connection_that_makes_no_call_is_closed_within_the_head_bound(harness, layer) -> None:
    """Neither a TLS connection that never starts the sealing nor a sealed one without a call
    holds the server's thread past :data:`HEAD_SECONDS`."""
    server = harness()
    with _dial(server, layer) as sock:
        started = time.monotonic()
        assert _closed(sock)
    assert time.monotonic() - started < HEAD_SECONDS + 5.0


@pytest.mark.parametrize("fault", ["unsealed", "changed", "replayed"])
def test_a_frame_that_does_not_open_closes_the_connection_and_nothing_else(harness, fault) -> None:
    """Bytes that are not the next sealed frame (sent in the clear after TLS ended, changed on the
    way, or a frame sent again) end the connection; a good connection still gets its call."""
    server = harness()
    request = pb.TaskRequest(session="none", wait_seconds=0).SerializeToString()
    with _dial(server) as sock:
        call = CALL_HEAD.pack(MAGIC, GET_TASK, 1000, len(_token(server))) + _token(server)
        frame = sock.frame(call)
        wire = {"unsealed": LENGTH.pack(len(call)) + call + bytes(16),
                "changed": frame[:-1] + bytes([frame[-1] ^ 1]),
                "replayed": frame + frame}[fault]
        sock.raw.sendall(wire)
        assert _closed(sock)
    with _dial(server) as sock:
        assert _call(sock, GET_TASK, _token(server), [request])[1] == grpc.StatusCode.NOT_FOUND


def test_fedparts_link_sends_tokens_sessions_and_tensors_only_sealed(harness) -> None:
    """What fedpart's client sends to the data port, recorded on the wire: neither the token, nor
    the session, nor a result's tensor bytes appear in it (they go in sealed frames), and the
    result is taken."""
    server = harness()
    recorder = _Recorder(server.server.data_address)
    token = _token(server).decode()
    security = ClientSecurity(ca=(server.secrets / "ca.pem").read_bytes(), token=token, server_name="127.0.0.1")
    link = DataLink("127.0.0.1", int(recorder.address.rpartition(":")[2]), security)
    value = 0.123
    try:
        stub = server.stub(0)
        session = _join(stub, [0, 1]).session
        other = server.stub(1)
        _ready(other, _join(other, [2, 3]).session)
        server.start_round()

        async def train() -> tuple[pb.SubmitReply, int]:
            request = pb.TaskRequest(session=session, wait_seconds=BOUND / 2)
            while True:
                chunks = [chunk async for chunk in link.get_task(request, BOUND)]
                header = chunks[0].header
                if header.kind != pb.IDLE:
                    break
            uploads = {n: torch.full_like(server.coordinator.global_state[n], value) for n in header.train.upload_deltas}
            chunks = [chunk.SerializeToString() for chunk in _result(session, header, uploads)]
            return await link.submit_result(chunks, BOUND), sum(t.numel() * t.element_size() for t in uploads.values())

        reply, tensor_bytes = asyncio.run(train())
        assert reply.accepted
    finally:
        link.close()
        recorder.close()
    seen = bytes(recorder.sent)
    assert len(seen) > tensor_bytes  # the result went this way
    assert token.encode() not in seen
    assert session.encode() not in seen
    assert struct.pack("<f", value) * 4 not in seen
