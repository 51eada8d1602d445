"""Transport security and client-process credentials, shared by server and client.

A server runs with TLS (its certificate; optionally mutual TLS, where clients present
certificates signed by a client CA) and a credentials file that authorizes each client process
for a fixed set of client ids, by a bearer token (stored as its SHA-256 only) and/or by the
common name of its client certificate. Plaintext without credentials exists only behind an
explicit ``--insecure``, on loopback as anywhere else (DESIGN.md section 8); tokens never travel
without TLS.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

from fedpart.common.wire.client_ids import parse_id_ranges

TOKEN_ENV = "FEDPART_TOKEN"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class SecurityError(ValueError):
    """Security settings that cannot be used (missing file, bad credentials file, ...)."""


def hash_token(token: str) -> str:
    """The SHA-256 hex digest under which a server keeps a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as in HOST:PORT, IPv6 in brackets) is a loopback address or localhost."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise SecurityError(f"cannot read the {what} {path}: {error.strerror or error}") from error


@dataclass(frozen=True)
class Principal:
    """One client process the server admits, and the client ids it may host."""

    name: str
    clients: frozenset[int]
    token_sha256: str | None = None
    certificate: str | None = None  # common name of its client certificate (mutual TLS)


def load_credentials(path: str | Path) -> list[Principal]:
    """Read a credentials file (see docs/operations.md); every entry is checked."""
    try:
        raw = yaml.safe_load(_read(path, "credentials file"))
    except yaml.YAMLError as error:
        raise SecurityError(f"{path}: not valid YAML ({error})") from error
    entries = raw.get("processes") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise SecurityError(f"{path}: expected a non-empty list under 'processes'")
    principals: list[Principal] = []
    for index, entry in enumerate(entries):
        where = f"{path}: processes[{index}]"
        if not isinstance(entry, dict):
            raise SecurityError(f"{where}: expected a mapping")
        unknown = set(entry) - {"name", "clients", "token_sha256", "certificate"}
        if unknown:
            raise SecurityError(f"{where}: unknown keys {sorted(unknown)}")
        name = str(entry.get("name") or f"process_{index}")
        try:
            clients = frozenset(parse_id_ranges(entry.get("clients", "")))
        except ValueError as error:
            raise SecurityError(f"{where} ({name}): clients: {error}") from error
        token = entry.get("token_sha256")
        if token is not None and not (isinstance(token, str) and _HEX64.match(token)):
            raise SecurityError(f"{where} ({name}): token_sha256 must be 64 lowercase hex digits")
        certificate = entry.get("certificate")
        if certificate is not None and not isinstance(certificate, str):
            raise SecurityError(f"{where} ({name}): certificate must be a common name")
        if token is None and certificate is None:
            raise SecurityError(f"{where} ({name}): needs token_sha256 or certificate")
        principals.append(Principal(name, clients, token, certificate))
    tokens = [p.token_sha256 for p in principals if p.token_sha256]
    if len(set(tokens)) != len(tokens):
        raise SecurityError(f"{path}: two processes share a token")
    return principals


@dataclass
class ServerSecurity:
    """How the server listens: TLS material (None: plaintext) and whom it admits (None: anyone)."""

    certificate: bytes | None = None
    private_key: bytes | None = None
    client_ca: bytes | None = None          # mutual TLS: client certificates must chain to it
    principals: list[Principal] | None = None
    credentials_file: Path | None = None    # where the principals come from (re-read while the server runs)
    credentials_content: bytes = b""        # its bytes when it was read

    @classmethod
    def from_files(cls, address: str, tls_cert: str | None, tls_key: str | None, client_ca: str | None,
                   credentials: str | None, insecure: bool) -> ServerSecurity:
        """Check the combination of command-line options."""
        if bool(tls_cert) != bool(tls_key):
            raise SecurityError("--tls-cert and --tls-key go together")
        if insecure and (tls_cert or client_ca or credentials):
            raise SecurityError("--insecure cannot be combined with TLS or credentials options")
        if client_ca and not tls_cert:
            raise SecurityError("--client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if credentials and not tls_cert:
            raise SecurityError("--credentials needs TLS (--tls-cert, --tls-key): tokens never travel in clear")
        if not tls_cert and not insecure:
            raise SecurityError("give --tls-cert, --tls-key and --credentials (make them with `fedpart certs`), or "
                                "--insecure for plaintext without client authentication (on loopback too: "
                                "any local user could join)")
        if tls_cert and not credentials:
            raise SecurityError(f"give --credentials so that only authorized client processes can join {address}")
        return cls(
            certificate=_read(tls_cert, "TLS certificate") if tls_cert else None,
            private_key=_read(tls_key, "TLS private key") if tls_key else None,
            client_ca=_read(client_ca, "client CA certificate") if client_ca else None,
            principals=load_credentials(credentials) if credentials else None,
            credentials_file=Path(credentials).resolve() if credentials else None,
            credentials_content=_read(credentials, "credentials file") if credentials else b"",
        )

    @property
    def tls(self) -> bool:
        return self.certificate is not None

    def describe(self) -> str:
        """One line for the server log."""
        if not self.tls:
            return "INSECURE: plaintext, no client authentication"
        mode = "mutual TLS" if self.client_ca else "TLS"
        who = f"{len(self.principals)} authorized client processes" if self.principals else "any client"
        return f"{mode}, {who}"

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.certificate)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass
class ClientSecurity:
    """How a client process connects: the CA it trusts, its token and/or certificate."""

    ca: bytes | None = None
    server_name: str | None = None          # name to check in the server certificate
    certificate: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None
    insecure: bool = False

    @classmethod
    def from_options(cls, ca: str | None, server_name: str | None, token_file: str | None,
                     cert: str | None, key: str | None, insecure: bool,
                     credential_required: bool = True) -> ClientSecurity:
        """Command-line options (and ``FEDPART_TOKEN``) checked: plaintext only with ``insecure``;
        otherwise TLS, with a token or a client certificate unless ``credential_required`` is False
        (a health check needs none)."""
        if bool(cert) != bool(key):
            raise SecurityError("--cert and --key go together")
        token = None
        if token_file:
            token = _read(token_file, "token file").decode().strip()
            if not token:
                raise SecurityError(f"the token file {token_file} is empty")
        elif os.environ.get(TOKEN_ENV):
            token = os.environ[TOKEN_ENV].strip()
        if insecure and (ca or cert or token):
            raise SecurityError("--insecure cannot be combined with --ca, --cert or a token")
        if insecure:
            return cls(insecure=True)
        if credential_required and not cert and not token:
            raise SecurityError("give this process's credential: --token-file (or FEDPART_TOKEN) and --ca, or "
                                "--cert and --key (see `fedpart certs`); or --insecure for a server that runs "
                                "without authentication")
        return cls(ca=_read(ca, "CA certificate") if ca else None, server_name=server_name,
                   certificate=_read(cert, "client certificate") if cert else None,
                   private_key=_read(key, "client private key") if key else None, token=token)

    def describe(self) -> str:
        """One line for the client log."""
        if self.insecure:
            return "plaintext"
        proofs = [what for what, held in (("a token", self.token), ("a client certificate", self.certificate)) if held]
        return f"TLS{' with ' + ' and '.join(proofs) if proofs else ''}"

    def _credentials(self, options: list[tuple[str, object]], with_token: bool = True
                     ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, object]]]:
        """Channel credentials (None: plaintext) and the options that go with them; the token
        rides on them as call credentials unless ``with_token`` is False."""
        if self.insecure:
            return None, options
        credentials = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                                   certificate_chain=self.certificate)
        if self.token and with_token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.token))
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return credentials, options

    def channel(self, target: str, options: list[tuple[str, object]]) -> grpc.Channel:
        """A channel to ``target`` with these credentials (the token rides on every call)."""
        credentials, options = self._credentials(options)
        if credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, credentials, options=options)

    def aio_channel(self, target: str, options: list[tuple[str, object]]) -> grpc.aio.Channel:
        """The same as :meth:`channel` for asyncio callers, except that the token is not on it:
        each call passes :meth:`call_metadata`."""
        credentials, options = self._credentials(options, with_token=False)
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, credentials, options=options)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call on an :meth:`aio_channel` carries: the token, as the bearer
        credential that gRPC's token call credentials send (none in plaintext). As metadata it
        costs nothing per call, where gRPC Python runs call credentials on a thread it starts
        for every call."""
        if self.insecure or not self.token:
            return ()
        return (("authorization", f"Bearer {self.token}"),)
