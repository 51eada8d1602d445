"""Why a client process cannot reach its server, when trying again will not help.

gRPC reports an untrusted certificate, a name the certificate does not cover, TLS against
plaintext and an unresolvable host all as ``UNAVAILABLE``, the code of a server that is not up
yet. :func:`permanent_problem` looks again, directly and with the standard library: it resolves
the host, connects, and speaks to the server as the channel would (TLS with the same CA, server
name, client certificate and ALPN ``h2``, or plaintext HTTP/2), then says in one line what to fix.
What it cannot tell from a server that is down, starting or busy (a refused or timed-out
connection, a server that answers as expected, a name server that does not answer) is transient:
None, and the caller keeps its backoff. Refused credentials come from the call's status code.
Every diagnosis ends within :data:`DIAGNOSIS_SECONDS`.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

import grpc
from cryptography import x509

from fedpart.common.wire.security import ClientSecurity, is_loopback

DIAGNOSIS_SECONDS = 5.0  # the whole diagnosis: name resolution, connections, handshakes, replies
# HTTP/2 (RFC 9113): the client's connection preface, then an empty SETTINGS frame. A server's
# first frame is its SETTINGS: 9 header bytes, type 0x4, stream 0.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])
_FRAME_HEADER_BYTES = 9
_SETTINGS = 0x4
_TLS_ALERT_RECORD = b"\x15\x03"  # content type alert, TLS major version 3
_CERTIFICATE_REQUEST = 13  # TLS handshake message type (RFC 8446 4.3.2)
# Resolver errors that say the name does not exist (or has no address); others (EAI_AGAIN: the
# name server did not answer) may pass.
_NO_SUCH_NAME = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY")
                 if hasattr(socket, name)}
# OpenSSL certificate verification codes (x509_vfy.h)
_NAME_MISMATCH = {62, 64}                   # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_UNKNOWN_ISSUER = {2, 18, 19, 20, 21}       # unable to get issuer, self-signed (in chain), unable to verify
_NOT_VALID_NOW = {9, 10}                    # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED
_BAD_SIGNATURE = 7                          # X509_V_ERR_CERT_SIGNATURE_FAILURE: a CA of the issuer's name, not its key
# TLS alerts (OpenSSL reason names) by which a server refuses the client's certificate, or its lack
_CLIENT_CERTIFICATE_ALERTS = ("CERTIFICATE_REQUIRED", "HANDSHAKE_FAILURE", "BAD_CERTIFICATE", "UNKNOWN_CA",
                              "CERTIFICATE_UNKNOWN", "UNSUPPORTED_CERTIFICATE", "CERTIFICATE_EXPIRED",
                              "CERTIFICATE_REVOKED", "DECRYPT_ERROR", "ACCESS_DENIED")
_HOST = re.compile(r"\[([0-9A-Fa-f:.%]+)\]|([A-Za-z0-9._-]+)")
_PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")


class _Inconclusive(Exception):
    """The probe could not tell (out of time, connection lost): treat the failure as transient."""


def permanent_problem(server: str, security: ClientSecurity, error: grpc.RpcError | None = None) -> str | None:
    """What to fix, in one line, when connecting to ``server`` (HOST:PORT) with ``security``
    cannot work however often it is tried; None when the failure may pass (or cannot be told).

    ``error`` is the call's failure, if any: refused credentials (``UNAUTHENTICATED``,
    ``PERMISSION_DENIED``) are permanent from the code alone; for ``UNAVAILABLE`` (or no error)
    the server is probed; other codes come from a server that answered, and are not diagnosed."""
    if error is not None:
        code = error.code()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return _refusal(server, code, error.details())
        if code != grpc.StatusCode.UNAVAILABLE:
            return None
    target = _host_and_port(server)
    if target is None or _behind_proxy(target[0]):
        return None  # not HOST:PORT, or the channel does not connect directly: nothing to probe
    try:
        return _Probe(server, *target, security).run()
    except (_Inconclusive, OSError):
        return None


def _refusal(server: str, code: grpc.StatusCode, details: str | None) -> str:
    said = _one_line(details or "no details")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"the server at {server} refused this process's credential ({said}): give the token "
                "(--token-file or FEDPART_TOKEN) or the client certificate (--cert, --key) its credentials "
                "file names")
    return (f"the server at {server} refused this process ({said}): check --clients against the client ids "
            "its credentials file gives this process's credential")


def _one_line(text: str, limit: int = 200) -> str:
    """A message from the other side, safe for one line of our output."""
    first = (text.splitlines() or [""])[0]
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in first[:limit])
    return escaped + ("..." if len(first) > limit else "")


def _host_and_port(server: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` or ``[IPv6]:PORT``; None for other gRPC targets."""
    host, _, port = server.rpartition(":")
    match = _HOST.fullmatch(host)
    if match is None or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return match.group(1) or match.group(2), int(port)


def _behind_proxy(host: str) -> bool:
    """Whether gRPC may reach ``host`` through an HTTP proxy named in the environment (it then
    resolves and connects elsewhere than a direct probe would)."""
    return not is_loopback(host) and any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARIABLES)


class _Probe:
    """One diagnosis of ``server``, within :data:`DIAGNOSIS_SECONDS`."""

    def __init__(self, server: str, host: str, port: int, security: ClientSecurity) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.security = security
        self.deadline = time.monotonic() + DIAGNOSIS_SECONDS
        self.address: tuple | None = None  # (family, sockaddr) that accepted a connection
        self.certificate_requested = False  # the server's handshake asked for a client certificate

    def run(self) -> str | None:
        addresses = self._resolve()
        if isinstance(addresses, str):
            return addresses
        self.address = self._reachable(addresses)
        if self.address is None:
            return None  # refused or unanswered: the server may not be up yet
        return self._plaintext_client() if self.security.insecure else self._tls_client()

    # ------------------------------------------------------------------ time, names, connections

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _Inconclusive("out of time")
        return remaining

    def _resolve(self) -> list[tuple] | str:
        """The host's addresses, or the problem when it has none. ``getaddrinfo`` cannot be given
        a timeout, so it runs on a daemon thread that the probe stops waiting for."""
        outcome: list[list[tuple] | socket.gaierror | UnicodeError] = []

        def resolve() -> None:
            try:
                outcome.append(socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM))
            except (socket.gaierror, UnicodeError) as error:  # UnicodeError: a label longer than 63
                outcome.append(error)

        thread = threading.Thread(target=resolve, name="fedpart-diagnose-resolve", daemon=True)
        thread.start()
        thread.join(self._remaining())
        if not outcome:
            raise _Inconclusive("the name server did not answer in time")
        result = outcome[0]
        if isinstance(result, UnicodeError):
            return f"{self.host} is not a valid host name ({result}); check --server"
        if isinstance(result, socket.gaierror):
            if result.errno in _NO_SUCH_NAME:
                return f"cannot resolve host {self.host}: {result.strerror}; check --server"
            raise _Inconclusive(str(result))
        return [(family, sockaddr) for family, _, _, _, sockaddr in result]

    def _reachable(self, addresses: list[tuple]) -> tuple | None:
        for family, sockaddr in addresses:
            try:
                self._connect((family, sockaddr)).close()
                return family, sockaddr
            except OSError:
                continue
        return None

    def _connect(self, address: tuple | None = None) -> socket.socket:
        family, sockaddr = address or self.address
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._remaining())
            sock.connect(sockaddr)
        except BaseException:
            sock.close()
            raise
        return sock

    # ------------------------------------------------------------------ plaintext client

    def _plaintext_client(self) -> str | None:
        with self._connect() as sock:
            answer = self._exchange_preface(sock)
        if _is_settings(answer):
            return None
        if answer.startswith(_TLS_ALERT_RECORD) or self._accepts_tls():
            return (f"the server at {self.server} uses TLS and this process connects in plaintext: give --ca (the CA "
                    "that signed the server's certificate) and --token-file (or --cert and --key)")
        return self._not_grpc(answer)

    def _accepts_tls(self) -> bool:
        """Whether the server completes (or refuses with a TLS alert) an unverified TLS handshake."""
        context = _unverified_context()
        try:
            with self._connect() as sock, context.wrap_socket(sock, server_hostname=self._expected_name()):
                return True
        except ssl.SSLError as error:
            return "ALERT" in (error.reason or "")
        except OSError:
            return False

    # ------------------------------------------------------------------ TLS client

    def _tls_client(self) -> str | None:
        try:
            context = self._verifying_context()
        except _MaterialError as error:
            return str(error)
        sock = self._connect()
        try:
            tls = context.wrap_socket(sock, server_hostname=self._expected_name())  # closes sock if it fails
        except ssl.SSLCertVerificationError as error:
            return self._certificate_problem(error)
        except ssl.SSLError as error:
            if _is_client_certificate_alert(error):
                return self._client_certificate_problem(_alert(error))
            return self._cut_handshake()
        except ConnectionError:
            return self._cut_handshake()
        with tls:
            if tls.selected_alpn_protocol() != "h2":
                return (f"the server at {self.server} answers TLS but not HTTP/2 (ALPN h2): it is not a gRPC "
                        "server; check --server")
            return self._tls_answer(tls)

    def _tls_answer(self, tls: ssl.SSLSocket) -> str | None:
        """After the handshake. With TLS 1.3 a server refuses a client certificate (or its
        absence) only now: gRPC's server by closing the connection before its SETTINGS, others with
        an alert on the first read."""
        try:
            answer = self._exchange_preface(tls)
        except ssl.SSLError as error:
            if _is_client_certificate_alert(error):
                return self._client_certificate_problem(_alert(error))
            raise _Inconclusive(str(error)) from error
        if _is_settings(answer):
            return None
        if not answer and self.certificate_requested:
            return self._client_certificate_problem(None)
        return self._not_grpc(answer)

    def _cut_handshake(self) -> str | None:
        """The TLS handshake failed without a verdict on either certificate: the server closed it
        after asking for a client certificate (TLS 1.2), or it speaks plaintext HTTP/2?"""
        if self.certificate_requested:
            return self._client_certificate_problem(None)
        with self._connect() as sock:
            answer = self._exchange_preface(sock)
        if _is_settings(answer):
            return (f"the server at {self.server} speaks plaintext and this process connects with TLS: start the "
                    "server with --tls-cert and --tls-key (see `fedpart certs`), or connect with --insecure and "
                    "no token or certificate")
        return None

    def _certificate_problem(self, error: ssl.SSLCertVerificationError) -> str:
        presented = self._peer_certificate()
        if error.verify_code in _NAME_MISMATCH:
            return self._name_problem(presented)
        issuer = f" (issued by {presented.issuer.rfc4514_string()})" if presented else ""
        certificate = f"the certificate of the server at {self.server}{issuer}"
        if error.verify_code in _UNKNOWN_ISSUER or error.verify_code == _BAD_SIGNATURE:
            if self.security.ca is None:
                return f"{certificate} is not signed by a CA this machine trusts: give the CA that signed it with --ca"
            if error.verify_code == _BAD_SIGNATURE:  # the CA in --ca has the issuer's name, not its key
                return (f"{certificate} is not signed by the CA in --ca, another CA of the same name: give the CA "
                        "that signed it (ca.pem of the same `fedpart certs` run as the server's certificate)")
            return (f"{certificate} is not signed by the CA in --ca ({_ca_subject(self.security.ca)}): give the CA "
                    "that signed it")
        if error.verify_code in _NOT_VALID_NOW:
            return f"{certificate} is not valid now ({error.verify_message}): renew it, or check this machine's clock"
        return f"{certificate} cannot be verified: {error.verify_message}"

    def _name_problem(self, presented: x509.Certificate | None) -> str:
        expected = self._expected_name()
        names = _certificate_names(presented) if presented else []
        holds = f" (it names {', '.join(names)})" if names else ""
        if self.security.server_name:
            fix = f"give one of its names with --server-name{holds}"
            return f"the certificate of the server at {self.server} does not name {expected} (--server-name): {fix}"
        fix = f"pass --server-name {names[0]}{holds}" if names else "pass --server-name with a name it holds"
        return f"the certificate of the server at {self.server} does not name {expected}; {fix}"

    def _client_certificate_problem(self, alert: str | None) -> str:
        how = f"TLS alert: {alert}" if alert else "it asked for one, then closed the connection"
        if self.security.certificate is None:
            return (f"the server at {self.server} requires a client certificate (mutual TLS; {how}): give --cert "
                    "and --key")
        return (f"the server at {self.server} refused this process's client certificate (--cert; {how}): it must be "
                "signed by the CA the server trusts for clients (its --client-ca)")

    def _peer_certificate(self) -> x509.Certificate | None:
        """The certificate the server presents, read by a handshake that verifies nothing."""
        try:
            with self._connect() as sock, _unverified_context().wrap_socket(
                    sock, server_hostname=self._expected_name()) as tls:
                der = tls.getpeercert(binary_form=True)
        except (OSError, _Inconclusive):
            return None
        return x509.load_der_x509_certificate(der) if der else None

    def _verifying_context(self) -> ssl.SSLContext:
        """TLS as the channel does it: the same roots, client certificate and ALPN."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.set_alpn_protocols(["h2"])
        if self.security.ca is not None:
            try:
                context.load_verify_locations(cadata=self.security.ca.decode("ascii", errors="replace"))
            except ssl.SSLError as error:
                raise _MaterialError("the CA file given with --ca holds no usable PEM certificate") from error
        else:
            _load_grpc_roots(context)
        if self.security.certificate is not None:
            _load_client_certificate(context, self.security.certificate, self.security.private_key or b"")
        if hasattr(context, "_msg_callback"):  # CPython's hook on OpenSSL's message callback (3.8+)
            context._msg_callback = self._note_handshake_message
        return context

    def _note_handshake_message(self, connection, direction: str, version, content_type, message_type, data) -> None:
        if direction == "read" and message_type == _CERTIFICATE_REQUEST:
            self.certificate_requested = True

    # ------------------------------------------------------------------ HTTP/2

    def _exchange_preface(self, sock: socket.socket) -> bytes:
        """Send the HTTP/2 preface; the first bytes of the answer (b"" when the server closed)."""
        sock.settimeout(self._remaining())
        sock.sendall(_H2_PREFACE)
        answer = b""
        try:
            while len(answer) < _FRAME_HEADER_BYTES:
                sock.settimeout(self._remaining())
                piece = sock.recv(_FRAME_HEADER_BYTES - len(answer))
                if not piece:
                    break
                answer += piece
        except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError):
            pass
        return answer

    def _not_grpc(self, answer: bytes) -> str | None:
        if answer.startswith(b"HTTP/1"):
            return f"the server at {self.server} speaks HTTP/1, not gRPC (HTTP/2): check --server"
        return None

    def _expected_name(self) -> str:
        return self.security.server_name or self.host


class _MaterialError(Exception):
    """The client's own TLS material (CA, certificate, key) cannot be used."""


def _is_settings(answer: bytes) -> bool:
    return (len(answer) == _FRAME_HEADER_BYTES and answer[3] == _SETTINGS
            and int.from_bytes(answer[5:9], "big") & 0x7FFFFFFF == 0)


def _is_client_certificate_alert(error: ssl.SSLError) -> bool:
    reason = error.reason or ""
    return "ALERT" in reason and reason.endswith(_CLIENT_CERTIFICATE_ALERTS)


def _alert(error: ssl.SSLError) -> str:
    """``TLSV13_ALERT_CERTIFICATE_REQUIRED`` -> ``certificate required``."""
    return (error.reason or "").partition("ALERT_")[2].lower().replace("_", " ")


def _unverified_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


def _load_grpc_roots(context: ssl.SSLContext) -> None:
    """The roots a gRPC channel without ``root_certificates`` trusts: the file in
    ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``, else those bundled with grpcio, else the system's."""
    path = os.environ.get("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
    bundled = resources.files("grpc") / "_cython" / "_credentials" / "roots.pem"
    if path and Path(path).is_file():
        context.load_verify_locations(cafile=path)
    elif bundled.is_file():
        context.load_verify_locations(cadata=bundled.read_text())
    else:
        context.load_default_certs()


def _load_client_certificate(context: ssl.SSLContext, certificate: bytes, key: bytes) -> None:
    """``ssl`` reads a certificate and key only from files: a private temporary directory."""
    with tempfile.TemporaryDirectory(prefix="fedpart-diagnose-") as folder:
        cert_path, key_path = Path(folder) / "client.pem", Path(folder) / "client.key"
        for path, data in ((cert_path, certificate), (key_path, key)):
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
        try:
            context.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as error:
            raise _MaterialError(f"the client certificate and key (--cert, --key) cannot be used: "
                                 f"{error.reason or error}") from error


def _certificate_names(certificate: x509.Certificate) -> list[str]:
    """The DNS names and IP addresses a certificate holds (its common name if it has none)."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))]
    except x509.ExtensionNotFound:
        return [str(a.value) for a in certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]


def _ca_subject(pem: bytes) -> str:
    try:
        return x509.load_pem_x509_certificate(pem).subject.rfc4514_string()
    except ValueError:
        return "not a PEM certificate"
