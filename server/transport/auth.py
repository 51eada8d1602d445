"""Who is calling, and how much of the server a caller may hold.

:class:`TokenGate` is a gRPC (asyncio) server interceptor: it runs before any handler is
scheduled, so a call without a known bearer token is refused (UNAUTHENTICATED) before it holds a
buffer or a task; the refusal is logged with the caller's address
(:class:`~fedpart.server.transport.admission.AdmissionLog`). With mutual TLS the handshake already refuses
clients without a certificate from the client CA, and the certificate's common name is matched
in :meth:`CallGuard.admit`. A health check (:data:`~fedpart.server.transport.health.CHECK_METHOD`) needs
no token: it answers at once and tells only whether the server and its run are serving.

:class:`CallGuard` admits each call of the Coordinator service: it resolves the caller's
:class:`~fedpart.common.wire.security.Principal`, requires a deadline no longer than the RPC's limit
(gRPC then cancels the call on the server at that deadline, so nothing waits forever on a silent
peer), caps the calls one principal has open at once, and caps the Coordinator calls open on the
whole server. Health checks are not Coordinator calls: they have a budget of their own
(:class:`~fedpart.server.transport.health.RunHealth`), so a full call cap never starves a liveness probe.

:class:`Credentials` holds the credentials file the server admits by. The server re-reads the file
while it runs (:meth:`Credentials.reload`): a process whose credential is no longer in it is
refused from its next call on, so a credential is revoked without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from fedpart.common.wire.security import Principal, SecurityError, hash_token, load_credentials
from fedpart.server.transport.admission import CERTIFICATE, UNKNOWN_TOKEN, AdmissionLog, peer_host
from fedpart.server.transport.health import CHECK_METHOD

# A client process runs its tasks one after another: one long poll, one upload, a heartbeat and
# the odd join or leave. Eight open calls leave room for a poll superseded by the next.
CALLS_PER_PRINCIPAL = 8


def _bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


class Principals:
    """The credentials file, indexed by token digest and by certificate name."""

    def __init__(self, principals: list[Principal]) -> None:
        self.all = tuple(principals)
        self.by_token = {p.token_sha256: p for p in principals if p.token_sha256}
        self.by_certificate = {p.certificate: p for p in principals if p.certificate}

    def by_bearer(self, token: str | None) -> Principal | None:
        if token is None:
            return None
        digest = hash_token(token)
        for known, principal in self.by_token.items():
            if hmac.compare_digest(known, digest):
                return principal
        return None


def fingerprint(content: bytes) -> str:
    """The SHA-256 of a credentials file's bytes: what a run records of the file it admits by."""
    return hashlib.sha256(content).hexdigest()


class Credentials:
    """The principals the server admits, swapped whole when their file changes."""

    def __init__(self, principals: list[Principal], path: Path | None = None, content: bytes = b"") -> None:
        self.principals = Principals(principals)
        self.path = path
        self.fingerprint = fingerprint(content) if content else ""

    def reload(self, check: Callable[[list[Principal]], None]) -> tuple[list[Principal], list[Principal]] | None:
        """Read the file again; when its bytes changed, check the new principals with ``check``
        (which raises SecurityError for a file the run cannot use) and take them. Returns the
        principals removed and added, or None when nothing changed. Raises SecurityError (and keeps
        the current principals) for a file that cannot be read or used."""
        if self.path is None:
            return None
        try:
            content = self.path.read_bytes()
        except OSError as error:
            raise SecurityError(f"cannot read the credentials file {self.path}: {error.strerror or error}") from error
        if fingerprint(content) == self.fingerprint:
            return None
        principals = load_credentials(self.path)
        check(principals)
        old = set(self.principals.all)
        self.principals = Principals(principals)
        self.fingerprint = fingerprint(content)
        return sorted(old - set(principals), key=lambda p: p.name), sorted(set(principals) - old, key=lambda p: p.name)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str,
             noted: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call at once, telling ``noted``
    the caller's address."""

    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        noted(context.peer())
        await context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class TokenGate(grpc.aio.ServerInterceptor):
    """Refuses calls whose bearer token is missing or unknown, unless mutual TLS may vouch."""

    def __init__(self, credentials: Credentials, mutual_tls: bool, admission: AdmissionLog) -> None:
        self.credentials = credentials
        self.mutual_tls = mutual_tls
        self.admission = admission

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method == CHECK_METHOD:
            return handler
        principals = self.credentials.principals
        token = _bearer_token(handler_call_details.invocation_metadata)
        if token is None and self.mutual_tls and principals.by_certificate:
            return handler  # the certificate's name is checked by CallGuard.admit
        if principals.by_bearer(token) is None:
            reason = "no bearer token" if token is None else "unknown token"
            method = handler_call_details.method.rpartition("/")[2]

            def noted(peer: str) -> None:
                self.admission.refusal(UNKNOWN_TOKEN, peer_host(peer), peer, f"a {method} call: {reason}")

            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            f"{reason}: this server admits only client processes named in its credentials", noted)
        return handler


class CallGuard:
    """Admission of one Coordinator call: principal, bounded deadline, per-principal and
    server-wide concurrency. Used from the server's event loop only."""

    def __init__(self, credentials: Credentials | None, mutual_tls: bool = False, max_calls: int | None = None,
                 admission: AdmissionLog | None = None) -> None:
        self.credentials = credentials
        self.mutual_tls = mutual_tls
        self.max_calls = max_calls
        self.admission = admission
        self.calls = 0  # Coordinator calls open on the server
        self._open: dict[str, int] = defaultdict(int)

    async def identify(self, context: grpc.aio.ServicerContext) -> Principal | None:
        """The caller's principal; None when the server admits anyone. Aborts if unknown."""
        if self.credentials is None:
            return None
        principals = self.credentials.principals
        token = _bearer_token(context.invocation_metadata())
        principal = principals.by_bearer(token)
        names = context.auth_context().get("x509_common_name", [])
        name = names[0].decode(errors="replace") if names else None
        if principal is None and token is None and name is not None:
            principal = principals.by_certificate.get(name)
        if principal is None:
            self._refused(context, UNKNOWN_TOKEN, "a call whose credential the credentials file does not name")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "this server admits only client processes named in its credentials")
        if self.mutual_tls and principal.certificate is not None and principal.certificate != name:
            self._refused(context, CERTIFICATE, f"a call of credential {principal.name!r} without its client "
                                                f"certificate (it presented {name!r})")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"credential {principal.name!r} requires its client certificate")
        return principal

    def _refused(self, context: grpc.aio.ServicerContext, kind: str, line: str) -> None:
        if self.admission is not None:
            peer = context.peer()
            self.admission.refusal(kind, peer_host(peer), peer, line)

    @asynccontextmanager
    async def admit(self, context: grpc.aio.ServicerContext, max_seconds: float) -> AsyncIterator[Principal | None]:
        """Admit a call for its duration; aborts when it has no bounded deadline, the caller
        already holds :data:`CALLS_PER_PRINCIPAL` calls, or the server holds ``max_calls``."""
        remaining = context.time_remaining()
        if remaining is None or remaining > max_seconds + 1.0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"every call needs a deadline of at most {max_seconds:.0f} s")
        principal = await self.identify(context)
        if self.max_calls is not None and self.calls >= self.max_calls:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server has {self.max_calls} calls open, its most; try again")
        key = principal.name if principal is not None else None
        if key is not None:
            if self._open[key] >= CALLS_PER_PRINCIPAL:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{principal.name} already has {CALLS_PER_PRINCIPAL} calls open")
            self._open[key] += 1
        self.calls += 1
        try:
            yield principal
        finally:
            self.calls -= 1
            if key is not None:
                self._open[key] -= 1
