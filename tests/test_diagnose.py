"""Fail fast and explain (issue 20): a connection that cannot work as configured is told apart from
a server that is not up yet, in one line that says what to fix, within a bound; gRPC's own log
lines stay off stderr unless ``--verbose``. Real certificates made in the test, real gRPC servers
on 127.0.0.1 (TLS, mutual TLS, plaintext, and fedpart's coordinator for refused credentials)."""

from __future__ import annotations

import re
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from conftest import child_env, small_config
from fedpart.client import diagnose
from fedpart.client.diagnose import permanent_problem
from fedpart.common.config.run_config import config_from_dict
from fedpart.common.wire.protocol import PROTOCOL_VERSION
from fedpart.common.wire.security import ClientSecurity, ServerSecurity, load_credentials
from fedpart.deploy.certs import KeyPair, _issue, write_run_credentials
from fedpart.proto import fedpart_pb2 as pb
from fedpart.proto import fedpart_pb2_grpc as pb_grpc
from fedpart.server.engine.coordinator import Coordinator
from fedpart.server.main import start_grpc

FAST = 2.0  # seconds: a diagnosis on loopback takes milliseconds; the bound allows a busy machine
CALL_SECONDS = 10.0
OTHER_NAME = "server.fedpart.test"
# A line of gRPC's C core: severity, date, time, thread, file:line]
CORE_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]", re.MULTILINE)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    """A run's credentials: CA, server certificate for 127.0.0.1 and localhost, two processes."""
    out = tmp_path_factory.mktemp("secrets")
    write_run_credentials(out, ["127.0.0.1", "localhost"], clients=4, processes=2)
    return out


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """Another `fedpart certs` run: a CA of the same name but another key."""
    out = tmp_path_factory.mktemp("other_run")
    write_run_credentials(out, ["127.0.0.1"], clients=1, processes=1)
    return out


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _run_ca(secrets: Path) -> KeyPair:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    return KeyPair(x509.load_pem_x509_certificate(_read(secrets / "ca.pem")),
                   serialization.load_pem_private_key(_read(secrets / "ca.key"), password=None))


class _Answer(grpc.GenericRpcHandler):
    """Answers every unary call with b"ok"."""

    def service(self, handler_call_details):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok")


@contextmanager
def _server(certificate: KeyPair | None = None, client_ca: bytes | None = None,
            key_pem: bytes | None = None, cert_pem: bytes | None = None) -> Iterator[str]:
    """A gRPC server on 127.0.0.1: TLS with the given certificate (mutual with ``client_ca``), or
    plaintext; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[_Answer()])
    if certificate is not None or cert_pem is not None:
        pair = (key_pem or certificate.key_pem(), cert_pem or certificate.certificate_pem())
        credentials = grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                                  require_client_auth=client_ca is not None)
        port = server.add_secure_port("127.0.0.1:0", credentials)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


@contextmanager
def _run_server(secrets: Path, mutual: bool = False) -> Iterator[str]:
    """TLS with the run's own server certificate and key, as `fedpart certs` wrote them."""
    with _server(key_pem=_read(secrets / "server.key"), cert_pem=_read(secrets / "server.pem"),
                 client_ca=_read(secrets / "ca.pem") if mutual else None) as address:
        yield address


class _BadRequest(socketserver.BaseRequestHandler):
    """What a web server (nginx, ...) answers to bytes it cannot read as HTTP/1."""

    def handle(self) -> None:
        self.request.recv(1024)
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


@contextmanager
def _web_server(tls_from: Path | None = None) -> Iterator[str]:
    """An HTTP/1 server (not gRPC) on 127.0.0.1; with TLS (no ALPN) from ``tls_from``'s server
    certificate."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _BadRequest)
    if tls_from is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls_from / "server.pem", tls_from / "server.key")
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1:%d" % server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=CALL_SECONDS)


def _call(address: str, security: ClientSecurity) -> grpc.RpcError | None:
    """One call as the client would make it; its error (None: it went through)."""
    channel = security.channel(address, options=[])
    try:
        channel.unary_unary("/probe/Call")(b"", timeout=CALL_SECONDS)
        return None
    except grpc.RpcError as error:
        return error
    finally:
        channel.close()


def _diagnose(address: str, security: ClientSecurity, error: grpc.RpcError | None = None) -> str | None:
    started = time.perf_counter()
    problem = permanent_problem(address, security, error)
    elapsed = time.perf_counter() - started
    assert elapsed < FAST, f"the diagnosis of {address} took {elapsed:.2f} s"
    return problem


def _client(secrets: Path, **changes) -> ClientSecurity:
    """The TLS client of process 0: the run's CA and its token, with ``changes``."""
    settings = {"ca": _read(secrets / "ca.pem"), "token": (secrets / "process_0.token").read_text().strip()}
    return ClientSecurity(**{**settings, **changes})


def _free_port() -> int:
    """A port nothing listens on (bound once, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------- what works is no problem

def test_a_correct_tls_setup_is_no_problem(secrets: Path) -> None:
    with _run_server(secrets) as address:
        assert _call(address, _client(secrets)) is None
        assert _diagnose(address, _client(secrets)) is None


def test_a_correct_plaintext_setup_is_no_problem() -> None:
    with _server() as address:
        assert _call(address, ClientSecurity(insecure=True)) is None
        assert _diagnose(address, ClientSecurity(insecure=True)) is None


def test_a_refused_connection_is_transient() -> None:
    address = f"127.0.0.1:{_free_port()}"
    error = _call(address, ClientSecurity(insecure=True))
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert _diagnose(address, ClientSecurity(insecure=True), error) is None


def test_a_server_that_never_answers_is_transient_and_the_probe_ends_in_time(secrets: Path, monkeypatch) -> None:
    """A listening socket nobody serves: the TCP connection is taken, no byte ever comes back."""
    monkeypatch.setattr(diagnose, "DIAGNOSIS_SECONDS", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        for security in (ClientSecurity(insecure=True), _client(secrets)):
            started = time.perf_counter()
            assert permanent_problem(address, security) is None
            assert time.perf_counter() - started < 1.0 + FAST


def test_targets_that_are_not_host_and_port_are_not_probed() -> None:
    for target in ("unix:/tmp/fedpart.sock", "dns:///localhost:50051", "localhost"):
        assert _diagnose(target, ClientSecurity(insecure=True)) is None


# ---------------------------------------------------------------------- permanent problems

def test_a_server_certificate_from_an_unknown_ca(secrets: Path) -> None:
    stranger = _issue("other CA", None)
    with _run_server(secrets) as address:
        security = _client(secrets, ca=stranger.certificate_pem())
        error = _call(address, security)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security, error) == (
            f"the certificate of the server at {address} (issued by CN=fedpart run CA) is not signed by the CA "
            "in --ca (CN=other CA): give the CA that signed it")


def test_a_server_certificate_from_another_run_with_a_ca_of_the_same_name(secrets: Path, other_run: Path) -> None:
    with _run_server(secrets) as address:
        security = _client(secrets, ca=_read(other_run / "ca.pem"))
        assert _call(address, security).code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security) == (
            f"the certificate of the server at {address} (issued by CN=fedpart run CA) is not signed by the CA "
            "in --ca, another CA of the same name: give the CA that signed it (ca.pem of the same `fedpart certs` "
            "run as the server's certificate)")


def test_no_ca_given_and_a_private_ca(secrets: Path) -> None:
    with _run_server(secrets) as address:
        security = _client(secrets, ca=None)
        assert _call(address, security).code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security) == (
            f"the certificate of the server at {address} (issued by CN=fedpart run CA) is not signed by a CA this "
            "machine trusts: give the CA that signed it with --ca")


def test_a_server_certificate_that_does_not_name_the_host_and_the_fix_it_suggests(secrets: Path) -> None:
    named_elsewhere = _issue(OTHER_NAME, _run_ca(secrets), server_names=[OTHER_NAME])
    with _server(named_elsewhere) as address:
        security = _client(secrets)
        assert _call(address, security).code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security) == (
            f"the certificate of the server at {address} does not name 127.0.0.1; pass --server-name {OTHER_NAME} "
            f"(it names {OTHER_NAME})")
        fixed = _client(secrets, server_name=OTHER_NAME)
        assert _call(address, fixed) is None
        assert _diagnose(address, fixed) is None


def test_a_server_name_override_that_the_certificate_does_not_hold(secrets: Path) -> None:
    with _run_server(secrets) as address:
        security = _client(secrets, server_name="example.org")
        assert _call(address, security).code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security) == (
            f"the certificate of the server at {address} does not name example.org (--server-name): give one of "
            "its names with --server-name (it names localhost, 127.0.0.1)")


def test_a_plaintext_client_against_a_tls_server(secrets: Path) -> None:
    with _run_server(secrets) as address:
        error = _call(address, ClientSecurity(insecure=True))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "Socket closed" in error.details()
        assert _diagnose(address, ClientSecurity(insecure=True), error) == (
            f"the server at {address} uses TLS and this process connects in plaintext: give --ca (the CA that "
            "signed the server's certificate) and --token-file (or --cert and --key)")


def test_a_tls_client_against_a_plaintext_server(secrets: Path) -> None:
    with _server() as address:
        security = _client(secrets)
        error = _call(address, security)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security, error) == (
            f"the server at {address} speaks plaintext and this process connects with TLS: start the server with "
            "--tls-cert and --tls-key (see `fedpart certs`), or connect with --insecure and no token or certificate")


def test_a_host_name_that_does_not_resolve(secrets: Path) -> None:
    host = "fedpart-diagnose.invalid"  # RFC 6761: never resolves
    try:
        socket.getaddrinfo(host, 50051, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        if error.errno not in diagnose._NO_SUCH_NAME:
            pytest.skip(f"this machine's resolver cannot say that {host} does not exist ({error})")
        strerror = error.strerror
    address = f"{host}:50051"
    error = _call(address, _client(secrets))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert _diagnose(address, _client(secrets), error) == f"cannot resolve host {host}: {strerror}; check --server"


def test_mutual_tls_without_a_client_certificate(secrets: Path) -> None:
    with _run_server(secrets, mutual=True) as address:
        security = _client(secrets)
        assert _call(address, security).code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security) == (
            f"the server at {address} requires a client certificate (mutual TLS; it asked for one, then closed the "
            "connection): give --cert and --key")


def test_mutual_tls_with_a_client_certificate_the_server_does_not_trust(secrets: Path) -> None:
    stranger = _issue("process_0", _issue("other CA", None), client=True)
    with _run_server(secrets, mutual=True) as address:
        security = _client(secrets, certificate=stranger.certificate_pem(), private_key=stranger.key_pem())
        assert _call(address, security).code() == grpc.StatusCode.UNAVAILABLE
        assert _diagnose(address, security) == (
            f"the server at {address} refused this process's client certificate (--cert; it asked for one, then "
            "closed the connection): it must be signed by the CA the server trusts for clients (its --client-ca)")
        trusted = _client(secrets, certificate=_read(secrets / "process_0.pem"),
                          private_key=_read(secrets / "process_0.key"))
        assert _call(address, trusted) is None
        assert _diagnose(address, trusted) is None


def test_a_web_server_is_not_grpc(secrets: Path) -> None:
    with _web_server() as address:
        assert _diagnose(address, ClientSecurity(insecure=True)) == (
            f"the server at {address} speaks HTTP/1, not gRPC (HTTP/2): check --server")
    with _web_server(tls_from=secrets) as address:
        assert _diagnose(address, _client(secrets)) == (
            f"the server at {address} answers TLS but not HTTP/2 (ALPN h2): it is not a gRPC server; check --server")


def test_unusable_tls_material_of_the_client(secrets: Path) -> None:
    with _run_server(secrets) as address:
        assert _diagnose(address, _client(secrets, ca=b"not a certificate")) == (
            "the CA file given with --ca holds no usable PEM certificate")
        mismatched = _client(secrets, certificate=_read(secrets / "process_0.pem"),
                             private_key=_read(secrets / "process_1.key"))
        assert _diagnose(address, mismatched) == (
            "the client certificate and key (--cert, --key) cannot be used: KEY_VALUES_MISMATCH")


def test_refused_credentials_come_from_the_status_code(secrets: Path) -> None:
    """fedpart's own server: a forged token, and a credential asking for another process's clients."""
    config = config_from_dict(small_config(clients=4, rounds=1))
    coordinator = Coordinator(config, log=lambda line: None)
    security = ServerSecurity(certificate=_read(secrets / "server.pem"), private_key=_read(secrets / "server.key"),
                              principals=load_credentials(secrets / "credentials.yaml"))
    server = start_grpc(coordinator, "127.0.0.1:0", security)
    try:
        def join(client: ClientSecurity, clients: list[int]) -> grpc.RpcError:
            channel = client.channel(server.address, options=[])
            request = pb.JoinRequest(protocol=PROTOCOL_VERSION, process_name="test",
                                     clients=[pb.HostedClient(id=c) for c in clients])
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.CoordinatorStub(channel).Join(request, timeout=CALL_SECONDS)
            channel.close()
            return refused.value

        forged = join(_client(secrets, token="forged"), [0, 1])
        assert forged.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _diagnose(server.address, _client(secrets, token="forged"), forged) == (
            f"the server at {server.address} refused this process's credential (unknown token: this server admits "
            "only client processes named in its credentials): give the token (--token-file or FEDPART_TOKEN) or "
            "the client certificate (--cert, --key) its credentials file names")
        others = join(_client(secrets), [2, 3])
        assert others.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _diagnose(server.address, _client(secrets), others) == (
            f"the server at {server.address} refused this process (credential 'process_0' may not host clients "
            "2-3; it names 0-1): check --clients against the client ids its credentials file gives this process's credential")
    finally:
        coordinator.finish()
        server.stop(grace=None)


# ---------------------------------------------------------------------- gRPC's own log lines

_LOGGING_SCRIPT = """
import sys
from concurrent import futures
from pathlib import Path

from fedpart.cli.main import main

out, options = Path(sys.argv[1]), sys.argv[2:]
assert "grpc" not in sys.modules
assert main([*options, "certs", "--out", str(out), "--server-names", "127.0.0.1", "--clients", "1",
             "--processes", "1"]) == 0
import os

import grpc

print("GRPC_VERBOSITY", os.environ.get("GRPC_VERBOSITY"), "FEDPART_VERBOSE", os.environ.get("FEDPART_VERBOSE"))
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
    [((out / "server.key").read_bytes(), (out / "server.pem").read_bytes())]))
server.start()
for channel in (grpc.insecure_channel(f"127.0.0.1:{port}"),  # plaintext against TLS
                grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials((out / "ca.pem").read_bytes()),
                                    options=[("grpc.ssl_target_name_override", "example.org")])):
    try:
        channel.unary_unary("/probe/Call")(b"", timeout=10)
    except grpc.RpcError as error:
        print(error.code().name)
    channel.close()
server.stop(grace=None)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_grpc_core_log_lines_only_with_verbose(tmp_path: Path, verbose: bool) -> None:
    """The command line quiets gRPC before it is imported; --verbose lets its lines through and
    hands the choice to the processes it starts (FEDPART_VERBOSE=1)."""
    env = {k: v for k, v in child_env().items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE", "FEDPART_VERBOSE")}
    script = subprocess.run([sys.executable, "-c", _LOGGING_SCRIPT, str(tmp_path / "certs"),
                             *(["--verbose"] if verbose else [])],
                            capture_output=True, text=True, env=env, timeout=120)
    assert script.returncode == 0, script.stderr
    assert script.stdout.splitlines()[-2:] == ["UNAVAILABLE", "UNAVAILABLE"]
    if verbose:
        assert "GRPC_VERBOSITY None FEDPART_VERBOSE 1" in script.stdout
        assert CORE_LOG_LINE.search(script.stderr), script.stderr
    else:
        assert "GRPC_VERBOSITY NONE FEDPART_VERBOSE None" in script.stdout
        assert not CORE_LOG_LINE.search(script.stderr), script.stderr
