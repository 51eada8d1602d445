"""Trust across networks (issue 6): TLS and per-process credentials, bounded calls and buffers,
validated evaluation results, escaped log fields. Hostile clients are raw stubs written against
the proto; certificates and tokens are real ones made by ``fedpart certs`` inside each test."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from conftest import fedpart_command, small_config, write_config
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.protocol import PROTOCOL_VERSION, method_path
from fedpart.common.wire.security import ClientSecurity, ServerSecurity, hash_token, load_credentials
from fedpart.common.wire.tensors import decode_chunks, encode_chunks, make_spec
from fedpart.deploy.certs import write_run_credentials
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.main import start_grpc

BOUND = 60.0


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    """A run's credentials: CA, server certificate for 127.0.0.1, two processes (clients 0-1, 2-3)."""
    out = tmp_path_factory.mktemp("secrets")
    write_run_credentials(out, ["127.0.0.1", "localhost"], clients=4, processes=2)
    return out


class SecureHarness:
    """An in-process coordinator behind TLS and credentials; rounds run on a thread."""

    def __init__(self, secrets: Path, mutual: bool = False, **overrides) -> None:
        overrides.setdefault("server", {"round_timeout": 30, "heartbeat_timeout": 30})
        self.config = config_from_dict(small_config(clients=4, rounds=1, **overrides))
        self.logs: list[str] = []
        self.coordinator = Coordinator(self.config, log=self.logs.append)
        self.initial = {k: v.clone() for k, v in self.coordinator.global_state.items()}
        security = ServerSecurity(certificate=(secrets / "server.pem").read_bytes(),
                                  private_key=(secrets / "server.key").read_bytes(),
                                  client_ca=(secrets / "ca.pem").read_bytes() if mutual else None,
                                  principals=load_credentials(secrets / "credentials.yaml"))
        self.server = start_grpc(self.coordinator, "127.0.0.1:0", security)
        self.address = self.server.address
        self.secrets = secrets
        self.channels: list[grpc.Channel] = []
        self._thread: threading.Thread | None = None

    def stub(self, process: int | None = 0, certificate: bool = False, token: str | None = None,
             ca: bool = True) -> pb_grpc.CoordinatorStub:
        """A raw stub with process ``process``'s token (None: no token) and optionally its certificate."""
        if process is not None and token is None:
            token = (self.secrets / f"process_{process}.token").read_text().strip()
        name = f"process_{process if process is not None else 0}"
        security = ClientSecurity(ca=(self.secrets / "ca.pem").read_bytes() if ca else None, token=token,
                                  certificate=(self.secrets / f"{name}.pem").read_bytes() if certificate else None,
                                  private_key=(self.secrets / f"{name}.key").read_bytes() if certificate else None)
        channel = security.channel(self.address, options=[])
        self.channels.append(channel)
        return pb_grpc.CoordinatorStub(channel)

    def start_round(self) -> None:
        def drive() -> None:
            self.coordinator.registry.wait_for_clients()
            self.coordinator.run_round(1)

        self._thread = threading.Thread(target=drive, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.coordinator.finish()
        for channel in self.channels:
            channel.close()
        self.server.stop(grace=None)


@pytest.fixture
def secure(secrets):
    made: list[SecureHarness] = []

    def make(**overrides) -> SecureHarness:
        harness = SecureHarness(secrets, **overrides)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def _join(stub: pb_grpc.CoordinatorStub, clients: list[int], name: str = "test") -> pb.JoinReply:
    return stub.Join(pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name=name,
                                    clients=[pb.HostedClient(id=c) for c in clients]), timeout=BOUND)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def _poll(stub, session: str, wait: float = BOUND / 2) -> tuple[pb.TaskHeader, dict]:
    request = pb.TaskRequest(session=session, wait_seconds=wait)
    while True:
        header, tensors = decode_chunks(stub.GetTask(request, timeout=BOUND))
        if header.kind != pb.IDLE:
            return header, tensors


def _ready(stub, session: str) -> None:
    """One short poll: the process counts as ready for round 1."""
    decode_chunks(stub.GetTask(pb.TaskRequest(session=session, wait_seconds=0), timeout=BOUND))


def _result(session: str, header: pb.TaskHeader, uploads: dict[str, torch.Tensor],
            samples: int = 10, metrics: dict | None = None, chunk_bytes: int = 1 << 20) -> Iterator[pb.ResultChunk]:
    result = pb.ResultHeader(session=session, task_id=header.task_id, client_id=header.client_id,
                             round=header.round, num_samples=samples, metrics=metrics or {"loss": 1.0},
                             tensors=[make_spec(n, t) for n, t in uploads.items()])
    return encode_chunks(pb.ResultChunk, result, list(uploads.values()), chunk_bytes)


# ---------------------------------------------------------------------------- 1. identity


def test_a_process_without_a_credential_gets_nothing(secure) -> None:
    harness = secure()
    assert _code(lambda: _join(harness.stub(None), [0, 1])) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: _join(harness.stub(token="forged"), [0, 1])) == grpc.StatusCode.UNAUTHENTICATED
    # a plaintext client cannot even talk to the TLS port
    plain = grpc.insecure_channel(harness.address)
    harness.channels.append(plain)
    with pytest.raises(grpc.RpcError):
        _join(pb_grpc.CoordinatorStub(plain), [0, 1])
    assert harness.coordinator.registry._processes == {}


def test_the_asyncio_channel_carries_the_token_per_call_without_a_thread_per_call(secure, monkeypatch) -> None:
    """The client's asyncio channel sends the token as call metadata: admitted like gRPC's token
    call credentials, without the thread gRPC Python starts for those on every call."""
    import asyncio

    harness = secure()
    token = (harness.secrets / "process_0.token").read_text().strip()
    security = ClientSecurity(ca=(harness.secrets / "ca.pem").read_bytes(), token=token)
    assert ClientSecurity(insecure=True, token=token).call_metadata() == ()
    request = pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name="aio", clients=[pb.HostedClient(id=0), pb.HostedClient(id=1)])

    async def calls() -> tuple[pb.JoinReply, grpc.StatusCode, int]:
        async with security.aio_channel(harness.address, options=[]) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as without:
                await stub.Join(request, timeout=BOUND)
            started: list[threading.Thread] = []
            start = threading.Thread.start
            monkeypatch.setattr(threading.Thread, "start", lambda thread: (started.append(thread), start(thread))[1])
            reply = await stub.Join(request, timeout=BOUND, metadata=security.call_metadata())
            for _ in range(10):
                await stub.Heartbeat(pb.HeartbeatRequest(session=reply.session), timeout=BOUND,
                                     metadata=security.call_metadata())
            return reply, without.value.code(), len(started)

    reply, without_token, threads_started = asyncio.run(calls())
    assert without_token == grpc.StatusCode.UNAUTHENTICATED
    assert reply.session and threads_started == 0
    assert harness.coordinator.registry._processes  # joined under process_0's credential


def test_a_credential_hosts_only_its_own_clients(secure) -> None:
    harness = secure()
    with pytest.raises(grpc.RpcError) as error:
        _join(harness.stub(0), [2])
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "process_0" in error.value.details() and "2" in error.value.details()
    reply = _join(harness.stub(0), [0, 1])
    assert reply.run_id == harness.coordinator.run_id


def _waiting_poll(harness: SecureHarness, stub: pb_grpc.CoordinatorStub, session: str):
    """A long poll of ``session`` that waits on the server (returned as its call, to cancel)."""
    call = stub.GetTask(pb.TaskRequest(session=session, wait_seconds=50), timeout=BOUND)
    deadline = time.monotonic() + BOUND
    while not harness.coordinator.registry.process(session).connected:
        assert time.monotonic() < deadline, "the poll never arrived"
        time.sleep(0.02)
    return call


def test_one_live_process_per_credential(secure) -> None:
    """Another credential never takes a process's clients; the same credential is refused while
    its process is connected (ALREADY_EXISTS, naming it), told to wait while it is silent but not
    gone (UNAVAILABLE), and takes over once the process's connection closed."""
    harness = secure()
    owner_stub = harness.stub(0)
    owner = _join(owner_stub, [0, 1], name="owner")
    assert _code(lambda: _join(harness.stub(1), [0, 1])) == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as silent:
        _join(harness.stub(0), [0, 1], name="second")
    assert silent.value.code() == grpc.StatusCode.UNAVAILABLE and "silent for" in silent.value.details()
    poll = _waiting_poll(harness, owner_stub, owner.session)
    with pytest.raises(grpc.RpcError) as held:
        _join(harness.stub(0), [0, 1], name="second")
    assert held.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "credential 'process_0' is held by a live process, owner at ipv4:127.0.0.1:" in held.value.details()
    poll.cancel()  # the owner's connection closes, as when its process dies
    deadline = time.monotonic() + BOUND
    while not harness.coordinator.registry.process(owner.session).disconnected:
        assert time.monotonic() < deadline, "the server never saw the poll end"
        time.sleep(0.02)
    restarted = _join(harness.stub(0), [0, 1], name="restarted")
    live = [p for p in harness.coordinator.registry._processes.values() if p.alive]
    assert [p.session for p in live] == [restarted.session]
    lines = "\n".join(harness.logs)
    assert "warning: refused the join of second: credential 'process_0' is held by a live process" in lines
    assert "restarted took over credential 'process_0' from owner" in lines and "(from ipv4:127.0.0.1:" in lines


def test_a_result_on_the_wire_shows_its_process_connected_until_it_is_cut(secure) -> None:
    """A process killed while its result is on the wire, with no poll or heartbeat of it open
    (a slow link holds the next heartbeat behind the upload): while the stream is open a second
    process with its credential is refused as the live one's; once the stream is cut short the
    restarted process takes over at once, not after ``server.heartbeat_timeout``."""
    harness = secure()
    stub, session, header, uploads = _train_task(harness)
    registry = harness.coordinator.registry
    assert not registry.process(session).connected
    first, *_ = _result(session, header, uploads, chunk_bytes=1024)
    release = threading.Event()

    def killed_mid_upload() -> Iterator[pb.ResultChunk]:
        yield first
        release.wait(BOUND)

    upload = stub.SubmitResult.future(killed_mid_upload(), timeout=BOUND)
    try:
        deadline = time.monotonic() + BOUND
        while not registry.process(session).connected:
            assert time.monotonic() < deadline, "the upload never arrived"
            time.sleep(0.02)
        assert _code(lambda: _join(harness.stub(0), [0, 1], name="second")) == grpc.StatusCode.ALREADY_EXISTS
        upload.cancel()  # the process dies: its connection closes mid-stream
        while not registry.process(session).disconnected:
            assert time.monotonic() < deadline, "the server never saw the stream cut"
            time.sleep(0.02)
    finally:
        release.set()
    restarted = _join(harness.stub(0), [0, 1], name="restarted")
    assert [p.session for p in registry._processes.values() if p.alive and 0 in p.clients] == [restarted.session]


def test_a_stolen_session_is_useless_without_its_credential(secure) -> None:
    harness = secure()
    victim = harness.stub(0)
    session = _join(victim, [0, 1]).session
    other = harness.stub(1)
    _ready(other, _join(other, [2, 3]).session)
    thief = harness.stub(1)
    harness.start_round()
    header, _ = _poll(victim, session)
    code = _code(lambda: decode_chunks(thief.GetTask(pb.TaskRequest(session=session, wait_seconds=1), timeout=BOUND)))
    assert code == grpc.StatusCode.NOT_FOUND
    uploads = {n: torch.zeros_like(harness.coordinator.global_state[n]) for n in header.train.upload_deltas}
    assert _code(lambda: thief.SubmitResult(_result(session, header, uploads), timeout=BOUND)) \
        == grpc.StatusCode.NOT_FOUND
    assert not thief.Heartbeat(pb.HeartbeatRequest(session=session), timeout=BOUND).known
    assert victim.SubmitResult(_result(session, header, uploads), timeout=BOUND).accepted


def test_mutual_tls_admits_by_certificate(secure) -> None:
    harness = secure(mutual=True)
    assert _join(harness.stub(None, certificate=True), [0, 1]).session
    with pytest.raises(grpc.RpcError) as error:
        _join(harness.stub(None, certificate=True), [2, 3])
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError):  # no client certificate: the handshake fails
        _join(harness.stub(0), [0, 1])


class _Recorder:
    """A loopback TCP relay that keeps every byte the client sent."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(downstream, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, downstream, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        try:
            while data := source.recv(65536):
                if record:
                    self.sent += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.listener.close()


def test_tokens_and_sessions_never_cross_the_wire_in_clear(secure, harness_plain) -> None:
    for harness, encrypted in ((secure(), True), (harness_plain, False)):
        recorder = _Recorder(harness.address)
        try:
            token = (harness.secrets / "process_0.token").read_text().strip() if encrypted else None
            security = ClientSecurity(ca=(harness.secrets / "ca.pem").read_bytes(), token=token,
                                      server_name="127.0.0.1") if encrypted else ClientSecurity(insecure=True)
            channel = security.channel(recorder.address, options=[])
            harness.channels.append(channel)
            stub = pb_grpc.CoordinatorStub(channel)
            session = _join(stub, [0, 1]).session
            stub.Heartbeat(pb.HeartbeatRequest(session=session), timeout=BOUND)
            seen = bytes(recorder.sent)
            assert (session.encode() in seen) is not encrypted
            if encrypted:
                assert token.encode() not in seen
        finally:
            recorder.close()


@pytest.fixture
def harness_plain(secrets):
    """The same coordinator on plaintext loopback (no credentials), for comparison."""
    config = config_from_dict(small_config(clients=4, rounds=1))
    coordinator = Coordinator(config, log=lambda m: None)
    server = start_grpc(coordinator, "127.0.0.1:0")
    address = server.address

    class Plain:
        pass

    plain = Plain()
    plain.address, plain.secrets, plain.channels = address, secrets, []
    yield plain
    coordinator.finish()
    for channel in plain.channels:
        channel.close()
    server.stop(grace=None)


def test_server_refuses_plaintext_without_insecure_on_loopback_too(tmp_path) -> None:
    config = write_config(tmp_path / "c.yaml", small_config())
    for address in ("0.0.0.0:0", "127.0.0.1:0"):
        refused = subprocess.run(fedpart_command("server", str(config), "--address", address, "--out",
                                                 str(tmp_path / "run")), capture_output=True, text=True, timeout=BOUND)
        assert refused.returncode == 2
        assert "--insecure for plaintext without client authentication" in refused.stderr, refused.stderr
        assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="tokens never travel in clear"):
        ServerSecurity.from_files("127.0.0.1:0", None, None, None, str(tmp_path / "credentials.yaml"), False)


# ---------------------------------------------------------------------------- 3. exhaustion


def _silent_stream(release: threading.Event):
    """A result stream that sends no message until ``release`` is set (bounded), then ends."""

    def silent() -> Iterator[pb.ResultChunk]:
        release.wait(BOUND)
        return
        yield

    return silent


def test_unauthenticated_and_unbounded_calls_hold_nothing(secure) -> None:
    harness = secure()
    stub = harness.stub(0)
    session = _join(stub, [0, 1]).session
    anonymous = harness.stub(None)
    never = threading.Event()
    silent = _silent_stream(never)

    with futures.ThreadPoolExecutor(64) as pool:
        streams = [pool.submit(lambda: _code(lambda: anonymous.SubmitResult(silent(), timeout=BOUND)))
                   for _ in range(40)]
        polls = [pool.submit(lambda: _code(lambda: list(anonymous.GetTask(
            pb.TaskRequest(session=session, wait_seconds=30), timeout=BOUND)))) for _ in range(600)]
        codes = {f.result(timeout=BOUND) for f in streams + polls}
        never.set()
    # refused at once: by the token gate, or by the server's cap on concurrent calls
    assert grpc.StatusCode.UNAUTHENTICATED in codes
    assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    started = time.monotonic()
    assert stub.Heartbeat(pb.HeartbeatRequest(session=session), timeout=BOUND).known
    assert time.monotonic() - started < 5.0
    # a call without a deadline (or a far one) is refused instead of being held open
    assert _code(lambda: stub.SubmitResult(silent(), timeout=100_000)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: stub.Heartbeat(pb.HeartbeatRequest(session=session))) == grpc.StatusCode.INVALID_ARGUMENT


def test_one_credential_holds_a_bounded_number_of_calls(secure) -> None:
    harness = secure()
    stub = harness.stub(0)
    _join(stub, [0, 1])
    release = threading.Event()
    silent = _silent_stream(release)

    with futures.ThreadPoolExecutor(16) as pool:
        calls = [pool.submit(lambda: _code(lambda: stub.SubmitResult(silent(), timeout=BOUND))) for _ in range(12)]
        deadline = time.monotonic() + BOUND
        while sum(c.done() for c in calls) < 4 and time.monotonic() < deadline:
            futures.wait(calls, timeout=0.5, return_when=futures.FIRST_COMPLETED)
        early = [c.result() for c in calls if c.done()]
        release.set()
    assert early == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4


def test_a_newer_poll_releases_the_older_one(secure) -> None:
    harness = secure()
    stub = harness.stub(0)
    session = _join(stub, [0, 1]).session
    with futures.ThreadPoolExecutor(2) as pool:
        older = pool.submit(lambda: decode_chunks(stub.GetTask(pb.TaskRequest(session=session, wait_seconds=50),
                                                               timeout=BOUND)))
        deadline = time.monotonic() + BOUND
        processes = harness.coordinator.registry._processes
        while not any(p.connected for p in processes.values()) and time.monotonic() < deadline:
            futures.wait([older], timeout=0.05)
        started = time.monotonic()
        newer = pool.submit(lambda: decode_chunks(stub.GetTask(pb.TaskRequest(session=session, wait_seconds=1),
                                                               timeout=BOUND)))
        header, _ = older.result(timeout=BOUND)
        assert header.kind == pb.IDLE and time.monotonic() - started < 10
        newer.result(timeout=BOUND)


# ---------------------------------------------------------------------------- 4. memory and bytes


def _train_task(harness: SecureHarness):
    stub = harness.stub(0)
    session = _join(stub, [0, 1]).session
    other = harness.stub(1)
    _ready(other, _join(other, [2, 3]).session)
    harness.start_round()
    header, _ = _poll(stub, session)
    uploads = {n: torch.zeros_like(harness.coordinator.global_state[n]) for n in header.train.upload_deltas}
    return stub, session, header, uploads


def test_a_header_declaring_a_huge_tensor_is_refused_before_any_allocation(secure) -> None:
    harness = secure()
    stub, session, header, uploads = _train_task(harness)
    name = next(iter(uploads))
    result = pb.ResultHeader(session=session, task_id=header.task_id, client_id=header.client_id, round=header.round,
                             num_samples=10, tensors=[pb.TensorSpec(name=name, dtype="float32", shape=[1 << 28])])
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitResult(iter([pb.ResultChunk(header=result)]), timeout=BOUND)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "differ from the expected" in error.value.details()
    assert harness.coordinator.ledger.totals(1)["up"] < 10_000


def test_junk_chunks_are_refused_and_not_counted_as_traffic(secure) -> None:
    harness = secure()
    stub, session, header, uploads = _train_task(harness)
    chunks = list(_result(session, header, uploads))
    junk = pb.ResultChunk()
    junk.pieces.add(index=0, data=b"")  # an empty piece: framing without tensor bytes
    before = harness.coordinator.ledger.totals(1)["up"]
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitResult(iter([chunks[0]] + [junk] * 2000 + chunks[1:]), timeout=BOUND)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must carry tensor bytes" in error.value.details()
    assert harness.coordinator.ledger.totals(1)["up"] == before
    assert harness.coordinator.ledger.refused_bytes > 0
    assert all(torch.equal(harness.initial[k], v) for k, v in harness.coordinator.global_state.items())


@pytest.mark.parametrize("position", ["first", "later"])
def test_bytes_that_are_no_result_chunk_are_refused_and_change_nothing(secure, position) -> None:
    """The server reads result chunks straight off the wire (``wire.read_chunk``, not protobuf's
    parser): bytes that do not parse as a ResultChunk are refused with the reason, whichever
    message of the stream they are."""
    harness = secure()
    stub, session, header, uploads = _train_task(harness)
    chunks = [chunk.SerializeToString() for chunk in _result(session, header, uploads)]
    submit_raw = harness.channels[0].stream_unary(method_path("SubmitResult"), request_serializer=None,
                                                  response_deserializer=pb.SubmitReply.FromString)
    cut_short = b"\x12\x80\x80\x04" + b"\0" * 100  # a piece of 64 KiB declared, 100 bytes sent
    stream = [cut_short] + chunks if position == "first" else chunks[:1] + [cut_short] + chunks[1:]
    before = harness.coordinator.ledger.totals(1)["up"]
    with pytest.raises(grpc.RpcError) as error:
        submit_raw(iter(stream), timeout=BOUND)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a chunk message: a field runs past the end" in error.value.details()
    assert harness.coordinator.ledger.totals(1)["up"] == before
    assert all(torch.equal(harness.initial[k], v) for k, v in harness.coordinator.global_state.items())
    if position == "first":  # the stream never named its task, which is still open
        assert stub.SubmitResult(iter(_result(session, header, uploads)), timeout=BOUND).accepted


def test_result_messages_larger_than_the_task_asked_for_are_refused(secure) -> None:
    harness = secure(server={"round_timeout": 30, "heartbeat_timeout": 30, "result_chunk_bytes": 4096})
    stub, session, header, uploads = _train_task(harness)
    assert header.result_chunk_bytes == 4096
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitResult(iter(_result(session, header, uploads, chunk_bytes=8192)), timeout=BOUND)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the 4096 its task asked for" in error.value.details()
    assert all(torch.equal(harness.initial[k], v) for k, v in harness.coordinator.global_state.items())


def test_an_oversized_message_inside_a_result_always_loses_the_result(secure) -> None:
    for attempt in range(4):
        harness = secure(server={"round_timeout": 30, "heartbeat_timeout": 30})
        other = harness.stub(1)
        other_session = _join(other, [2, 3]).session
        _ready(other, other_session)
        stub = harness.stub(0)
        session = _join(stub, [0, 1]).session
        harness.start_round()
        header, _ = _poll(stub, session)
        uploads = {n: torch.zeros_like(harness.coordinator.global_state[n]) for n in header.train.upload_deltas}
        chunks = list(_result(session, header, uploads, chunk_bytes=4096))
        assert len(chunks) > 2
        oversized = pb.ResultChunk()
        oversized.pieces.add(index=len(uploads) - 1, data=b"\0" * (5 << 20))
        with pytest.raises(grpc.RpcError) as error:
            stub.SubmitResult(iter(chunks[:-1] + [oversized] + chunks[-1:]), timeout=BOUND)
        assert error.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        for leaving, left in ((stub, session), (other, other_session)):  # the round ends without its clients
            leaving.Leave(pb.LeaveRequest(session=left, reason="the test is done"), timeout=BOUND)
        harness._thread.join(timeout=BOUND)
        assert not harness._thread.is_alive()
        assert all(torch.equal(harness.initial[k], v) for k, v in harness.coordinator.global_state.items()), attempt
        harness.close()


# ---------------------------------------------------------------------------- 5 and 7. evaluation, logs


@pytest.mark.parametrize("metrics, message", [
    ({"train_samples": 10.0, "initial_acc": 1.0, "initial_loss": 0.1}, "lacks ['test_samples']"),
    ({"train_samples": 10.0, "test_samples": 5.0, "initial_acc": 1.5, "initial_loss": 0.1,
      "finetune_1_loss": 0.1, "finetune_2_loss": 0.1}, "not an accuracy"),
    ({"train_samples": 10.0, "test_samples": 5.0, "initial_loss": 0.1}, "lacks ['finetune_1_loss'"),
    ({"train_samples": 10.0, "test_samples": 2.5, "initial_loss": 0.1}, "whole number"),
])
def test_evaluation_results_are_validated(secure, metrics, message) -> None:
    harness = secure()
    stub = harness.stub(0)
    session = _join(stub, [0, 1]).session
    other = harness.stub(1)
    _ready(other, _join(other, [2, 3]).session)
    thread = threading.Thread(target=lambda: (harness.coordinator.registry.wait_for_clients(),
                                              harness.coordinator.evaluate_all()), daemon=True)
    thread.start()
    header, _ = _poll(stub, session)
    assert header.kind == pb.EVALUATE
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitResult(_result(session, header, {}, metrics=metrics), timeout=BOUND)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    assert header.client_id not in harness.coordinator.evaluation.reports


def test_client_strings_cannot_forge_log_lines(secure) -> None:
    harness = secure()
    stub = harness.stub(0)
    session = _join(stub, [0, 1], name="evil\nerror: round 9 forged").session
    stub.Leave(pb.LeaveRequest(session=session, reason="gone\r\nwarning: forged too"), timeout=BOUND)
    assert harness.logs and all("\n" not in line and "\r" not in line for line in harness.logs)
    assert any("evil\\nerror: round 9 forged" in line for line in harness.logs)
    assert any("gone\\r\\nwarning: forged too" in line for line in harness.coordinator.failures)


def test_certs_command_writes_private_files_and_never_overwrites(tmp_path) -> None:
    out = tmp_path / "secrets"
    args = ["certs", "--out", str(out), "--server-names", "server.example,10.0.0.7", "--clients", "5",
            "--processes", "2"]
    made = subprocess.run(fedpart_command(*args), capture_output=True, text=True, timeout=BOUND)
    assert made.returncode == 0, made.stderr
    principals = load_credentials(out / "credentials.yaml")
    assert [sorted(p.clients) for p in principals] == [[0, 1], [2, 3, 4]]  # split_clients(5, 2)
    for name in ("ca.key", "server.key", "process_0.token", "process_1.key", "credentials.yaml"):
        assert (out / name).stat().st_mode & 0o777 == 0o600, name
    token = (out / "process_1.token").read_text().strip()
    assert principals[1].token_sha256 == hash_token(token)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = subprocess.run(fedpart_command(*args), capture_output=True, text=True, timeout=BOUND)
    assert again.returncode == 2 and "already holds credentials" in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
