"""Addresses on the command line: ``HOST:PORT`` to listen on or to dial, checked before anything
starts, so that a mistake is said at once instead of after a connect timeout (a ``--server`` without
its port would dial the default port 443 of TLS and give up minutes later).

gRPC's own target forms (``unix:PATH``, ``dns:///HOST:PORT``, ...) are left to gRPC.
"""

from __future__ import annotations

import socket

# The port the documentation's examples use (`fedpart server` listens on 127.0.0.1:50051 by default).
DOCUMENTED_PORT = 50051


class AddressInUse(OSError):
    """The server cannot listen on the address it was given (in use, or not this machine's)."""


def split_host_port(address: str) -> tuple[str, str] | None:
    """(host, port) of ``HOST:PORT`` or ``[IPv6]:PORT`` (the port as written); None for one of
    gRPC's own target forms."""
    if address.startswith("unix:") or "://" in address:
        return None
    host, colon, port = address.rpartition(":")
    if not colon or (host.count(":") and not host.startswith("[")):
        return address, ""  # no port (a bare IPv6 address has colons but no brackets)
    return host, port


def _port(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) <= 65535 else None


def check_dial_address(address: str, option: str) -> None:
    """Raise ValueError unless ``address`` is a ``HOST:PORT`` to dial (port 1-65535)."""
    parts = split_host_port(address)
    if parts is None:
        return
    host, port = parts
    if not host or not port:
        raise ValueError(f"{option} {address}: give HOST:PORT, the host and the port the server listens on "
                         f"(its --address), e.g. {host or 'HOST'}:{DOCUMENTED_PORT}")
    if not _port(port):
        raise ValueError(f"{option} {address}: {port!r} is not a port (1-65535)")


def check_listen_address(address: str, option: str) -> None:
    """Raise ValueError unless ``address`` is a ``HOST:PORT`` to listen on (port 0: any free one)."""
    parts = split_host_port(address)
    if parts is None:
        return
    host, port = parts
    if not host or not port or _port(port) is None:
        raise ValueError(f"{option} {address}: give HOST:PORT to listen on, e.g. 0.0.0.0:{DOCUMENTED_PORT} "
                         "(port 0: any free port)")


def check_address(address: str) -> None:
    """Raise :class:`AddressInUse` with the operating system's reason when ``HOST:PORT`` cannot
    be bound (in use, or not an address of this machine), before gRPC tries and logs its own
    error. Binds a probe socket the way gRPC binds (``SO_REUSEADDR``) and closes it."""
    parts = split_host_port(address)
    if parts is None or not parts[1].isdigit():
        return  # not HOST:PORT: gRPC says what is wrong
    host, port = parts
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (ValueError, socket.gaierror) as error:
        raise AddressInUse(f"cannot listen on {address}: {error}") from error
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as error:
            raise AddressInUse(f"cannot listen on {address}: {error.strerror or error}") from error
