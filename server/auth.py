"""Who is calling, and how much of the server a caller may hold.

:class:`TokenGate` is a gRPC (asyncio) server interceptor: it runs before any handler is
scheduled, so a call without a known bearer token is refused (UNAUTHENTICATED) before it holds a
buffer or a task. With mutual TLS the handshake already refuses
clients without a certificate from the client CA, and the certificate's common name is matched
in :meth:`CallGuard.admit`. A health check (:data:`~fedpart.server.health.CHECK_METHOD`) needs
no token: it answers at once and tells only whether the server and its run are serving.

:class:`CallGuard` admits each call inside the service: it resolves the caller's
:class:`~fedpart.common.security.Principal`, requires a deadline no longer than the RPC's limit
(gRPC then cancels the call on the server at that deadline, so nothing waits forever on a silent
peer), and caps the calls one principal has open at once.
"""

from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc

from fedpart.common.security import Principal, hash_token
from fedpart.server.health import CHECK_METHOD

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


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call at once."""

    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
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

    def __init__(self, principals: Principals, mutual_tls: bool) -> None:
        self.principals = principals
        self.mutual_tls = mutual_tls

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method == CHECK_METHOD:
            return handler
        token = _bearer_token(handler_call_details.invocation_metadata)
        if token is None and self.mutual_tls and self.principals.by_certificate:
            return handler  # the certificate's name is checked by CallGuard.admit
        if self.principals.by_bearer(token) is None:
            reason = "no bearer token" if token is None else "unknown token"
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            f"{reason}: this server admits only client processes named in its credentials")
        return handler


class CallGuard:
    """Admission of one call: principal, bounded deadline, per-principal concurrency. Used from
    the server's event loop only."""

    def __init__(self, principals: Principals | None, mutual_tls: bool = False) -> None:
        self.principals = principals
        self.mutual_tls = mutual_tls
        self._open: dict[str, int] = defaultdict(int)

    async def identify(self, context: grpc.aio.ServicerContext) -> Principal | None:
        """The caller's principal; None when the server admits anyone. Aborts if unknown."""
        if self.principals is None:
            return None
        token = _bearer_token(context.invocation_metadata())
        principal = self.principals.by_bearer(token)
        names = context.auth_context().get("x509_common_name", [])
        name = names[0].decode(errors="replace") if names else None
        if principal is None and token is None and name is not None:
            principal = self.principals.by_certificate.get(name)
        if principal is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "this server admits only client processes named in its credentials")
        if self.mutual_tls and principal.certificate is not None and principal.certificate != name:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"credential {principal.name!r} requires its client certificate")
        return principal

    @asynccontextmanager
    async def admit(self, context: grpc.aio.ServicerContext, max_seconds: float) -> AsyncIterator[Principal | None]:
        """Admit a call for its duration; aborts when it has no bounded deadline or the caller
        already holds :data:`CALLS_PER_PRINCIPAL` calls."""
        remaining = context.time_remaining()
        if remaining is None or remaining > max_seconds + 1.0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"every call needs a deadline of at most {max_seconds:.0f} s")
        principal = await self.identify(context)
        key = principal.name if principal is not None else None
        if key is not None:
            if self._open[key] >= CALLS_PER_PRINCIPAL:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{principal.name} already has {CALLS_PER_PRINCIPAL} calls open")
            self._open[key] += 1
        try:
            yield principal
        finally:
            if key is not None:
                self._open[key] -= 1
