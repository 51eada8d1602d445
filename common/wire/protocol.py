"""What both sides of the wire agree on beyond the messages of ``proto/fedpart.proto``: the
protocol version, the service's name, and the gRPC status codes the protocol gives a meaning to.

A client acts on the code of a refused call, never on its message:

- :data:`UNKNOWN_SESSION` (NOT_FOUND): the server does not know the session: it dropped the
  process after missed heartbeats, it is a resumed server, or the session was presented with
  another credential than the one that opened it (to the caller that is the same thing). The
  process joins again and goes on.
- :data:`RETRY_LATER_CODES`: the server is down, restarting, cut off or busy: the same call is
  tried again later, with backoff.
- :data:`RESULT_REJECTED` (INVALID_ARGUMENT): a result stream that matched an open task broke a
  rule (``server/policy/validation.py``) or could not be folded; the task is dropped, the round goes on.
  A result stream that ended before its last byte is answered UNAVAILABLE: it is sent again.
- a refused join ends the process with exit code 2 (``fedpart client``) when the operator must
  change something: INVALID_ARGUMENT (client ids outside the run, or not those of the credential),
  PERMISSION_DENIED (clients the credential does not name), ALREADY_EXISTS (another live process
  holds the credential or the client ids: one live process per credential); a join answered
  UNAVAILABLE (the holder is silent but not yet gone) is tried again like an unreachable server.
- anything else (FAILED_PRECONDITION: e.g. a late result, the run is over) ends the call with its
  message.

The server raises :class:`Rejected` and its subclasses; each carries the code it is sent with.
"""

from __future__ import annotations

import grpc

from fedpart.proto import fedpart_pb2 as pb

PROTOCOL_VERSION = 1

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name


def method_path(rpc: str) -> str:
    """The gRPC path of one of the service's RPCs, for calls that bring their own serializers."""
    return f"/{SERVICE_NAME}/{rpc}"


UNKNOWN_SESSION = grpc.StatusCode.NOT_FOUND
RESULT_REJECTED = grpc.StatusCode.INVALID_ARGUMENT
# Answers after which the same call is tried again later: the server is down, restarting, cut
# off, busy (it refuses calls beyond its cap at once rather than queueing them), or gRPC cancelled
# the call before the server took it (CANCELLED: seen for joins, heartbeats and result streams
# when 2,000 processes called at once, from gRPC's default backlog of calls waiting to be taken,
# which the server now raises to its cap on calls).
# Keepalive pings (both sides): a connection that stops answering them (its peer vanished, a NAT
# dropped the mapping, a route black-holes it) is closed within KEEPALIVE_SECONDS +
# KEEPALIVE_TIMEOUT_SECONDS, and the calls on it fail and are tried again on a new connection.
# gRPC times every ping out by the timeout (grpc.http2.ping_timeout_ms), the bandwidth probes a
# client sends while a task streams in included, and their answers queue behind the task bytes on
# the way: a short timeout closes busy connections behind one slow hop and sends their tasks
# again, so the timeout leaves room for a task's bytes (benchmarks/server_scale.py --relay).
KEEPALIVE_SECONDS = 10.0
KEEPALIVE_TIMEOUT_SECONDS = 20.0

RETRY_LATER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)


class Rejected(Exception):
    """A call the server refuses in the state it is in; the message says why."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Denied(Rejected):
    """A call whose credential does not cover what it asks for."""

    code = grpc.StatusCode.PERMISSION_DENIED


class BadJoin(Rejected):
    """A join the server can never take as it is (its client ids, its protocol version)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Held(Rejected):
    """A join for a credential (or client ids) that a live process holds."""

    code = grpc.StatusCode.ALREADY_EXISTS


class NotYet(Rejected):
    """A join the server may take later: the process holding the credential is silent, not yet gone."""

    code = grpc.StatusCode.UNAVAILABLE


# The trailing metadata key of a join answered UNAVAILABLE by the server itself (:class:`NotYet`):
# the server is there, so there is nothing to diagnose about the connection.
NOT_YET_KEY = "fedpart-not-yet"

# Join refusals that trying again cannot mend: the process exits with exit code 2.
JOIN_REFUSED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                      grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


class UnknownSession(Rejected):
    """A session the server does not know (or not with the caller's credential): join again."""

    code = UNKNOWN_SESSION


class InvalidResult(Rejected):
    """A result that breaks a rule of ``server/policy/validation.py``."""

    code = RESULT_REJECTED
