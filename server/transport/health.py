"""The standard gRPC health service (``grpc.health.v1.Health``, from ``grpcio-health-checking``)
for load balancers, Kubernetes probes and ``fedpart health``.

Two statuses: the server itself (service ``""``) is SERVING from the moment it listens until it
stops; the run (service :data:`RUN_SERVICE`, the Coordinator's full name) is SERVING while it
goes on and NOT_SERVING once it ended (the clients are being told, the summary written). Both
turn NOT_SERVING when the server stops.

Only ``Check`` is served: it answers at once, so it needs no bearer token (the token gate lets it
through, :data:`CHECK_METHOD`) and a probe cannot hold a call open; ``Watch`` (a stream held for
as long as the caller likes) and ``List`` answer UNIMPLEMENTED. With mutual TLS the handshake
still needs a client certificate, and Kubernetes' own gRPC probes speak plaintext: for them the
server can also serve ``Check``, and nothing else, on a plaintext port of its own
(``fedpart server --health-port``).

Health checks have a budget of their own, :data:`HEALTH_CALLS` checks at once (a check answers at
once, so only a flood reaches it): they do not count against the server's cap on Coordinator
calls, so a server whose call cap is full still answers its liveness probe.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedpart.common.wire.security import ClientSecurity
from fedpart.proto import fedpart_pb2 as pb

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
CHECK_METHOD = f"/{HEALTH_SERVICE}/Check"
RUN_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_CALLS = 64


class RunHealth:
    """The statuses a server reports (use from its event loop)."""

    def __init__(self) -> None:
        self._servicer = health.aio.HealthServicer()  # the server itself ("") starts SERVING
        self._checks = 0  # checks being answered (on the server's event loop)

    async def _check(self, request: health_pb2.HealthCheckRequest,
                     context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        if self._checks >= HEALTH_CALLS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{HEALTH_CALLS} health checks at once, "
                                                                    "the most this server answers")
        self._checks += 1
        try:
            return await self._servicer.Check(request, context)
        finally:
            self._checks -= 1

    def handler(self) -> grpc.GenericRpcHandler:
        """``Check`` of ``grpc.health.v1.Health``, for a server's generic handlers."""
        check = grpc.unary_unary_rpc_method_handler(
            self._check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(HEALTH_SERVICE, {"Check": check})

    async def run_serving(self, serving: bool) -> None:
        """The run goes on (clients may join and work) or has ended."""
        await self._servicer.set(RUN_SERVICE, SERVING if serving else NOT_SERVING)

    async def stopping(self) -> None:
        """The server stops: every status NOT_SERVING, for good."""
        await self._servicer.enter_graceful_shutdown()


def check_health(target: str, security: ClientSecurity, service: str, timeout: float) -> str:
    """The status (``SERVING``, ``NOT_SERVING``, ...) the server at ``target`` reports for
    ``service`` (``""``: the server itself). Raises :class:`grpc.RpcError` when it does not answer
    within ``timeout`` seconds, and with NOT_FOUND for a service it does not know."""
    with security.channel(target, options=[]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
