"""``fedpart certs``: the credentials of one run.

Writes a private CA, a server certificate for the names clients dial, and per client process a
random bearer token and a client certificate (common name ``process_K``, for mutual TLS), plus
the server's ``credentials.yaml`` that admits each process for its share of the client ids (the
split ``fedpart run`` uses). Keys are ECDSA P-256; private keys and tokens are written mode 0600, in
a directory of mode 0700 with a ``.gitignore`` of its own that keeps all of it out of version
control. Nothing is overwritten: a directory that already holds credentials is refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpart.common.wire.security import hash_token

VALID_DAYS = 365


@dataclass
class KeyPair:
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _subject_alternative_names(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name.strip("[]"))))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _issue(common_name: str, issuer: KeyPair | None, *, server_names: list[str] | None = None,
           client: bool = False) -> KeyPair:
    """A certificate for ``common_name`` signed by ``issuer`` (None: a self-signed CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name))
               .issuer_name(issuer.certificate.subject if issuer else _name(common_name))
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    if server_names:
        builder = (builder.add_extension(_subject_alternative_names(server_names), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    if client:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    signer = issuer.key if issuer else key
    return KeyPair(builder.sign(signer, hashes.SHA256()), key)


def _write(path: Path, data: bytes, private: bool) -> Path:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    with os.fdopen(os.open(path, flags, 0o600 if private else 0o644), "wb") as f:
        f.write(data)
    return path


def write_run_credentials(out: Path, server_names: list[str], clients: int, processes: int) -> list[Path]:
    """Write CA, server and per-process credentials for a run into ``out``; returns the files."""
    from fedpart.common.wire.client_ids import split_clients

    names = [n.strip() for n in server_names if n.strip()]
    if not names:
        raise ValueError("--server-names: give at least one host name or IP address")
    if clients < 1 or processes < 1:
        raise ValueError("--clients and --processes must be at least 1")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.iterdir() if p.name in ("ca.pem", "credentials.yaml", "server.pem"))
    if existing:
        raise ValueError(f"{out} already holds credentials ({', '.join(existing)}); choose another directory")
    out.chmod(0o700)  # only this user may list or enter it, whoever made it
    ignore = out / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# written by fedpart certs: keys and tokens never go into version control\n*\n")
    ca = _issue("fedpart run CA", None)
    server = _issue(names[0], ca, server_names=names)
    written = [_write(out / "ca.pem", ca.certificate_pem(), False), _write(out / "ca.key", ca.key_pem(), True),
               _write(out / "server.pem", server.certificate_pem(), False),
               _write(out / "server.key", server.key_pem(), True)]
    entries = []
    for index, ids in enumerate(split_clients(clients, processes)):
        name = f"process_{index}"
        token = secrets.token_urlsafe(32)
        pair = _issue(name, ca, client=True)
        written += [_write(out / f"{name}.token", token.encode() + b"\n", True),
                    _write(out / f"{name}.pem", pair.certificate_pem(), False),
                    _write(out / f"{name}.key", pair.key_pem(), True)]
        entries.append({"name": name, "clients": ids, "token_sha256": hash_token(token), "certificate": name})
    written.append(_write(out / "credentials.yaml",
                          yaml.safe_dump({"processes": entries}, sort_keys=False).encode(), True))
    return written
