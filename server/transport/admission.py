"""What the server says about the calls and joins it refuses, and about session takeovers: one
warning line each (with the peer's address), counts for Prometheus, and an alert line when one
credential or one peer keeps at it (DESIGN.md section 8: takeovers and refused joins are logged
with the peer's address; a burst is an alert).

A hostile or misconfigured peer can refuse itself thousands of times a minute: past
:data:`LINES_PER_WINDOW` warning lines for one subject (a credential's name, or a peer's host
where the call named no credential) in :data:`WINDOW_SECONDS`, its refusals are only counted, and
the first time it reaches :data:`ALERT_AT` events in a window one ``alert:`` line says how many,
from which peers, and what to do.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fedpart.common.process.console import Log

WINDOW_SECONDS = 60.0
LINES_PER_WINDOW = 5
ALERT_AT = 10

# Kinds of refusal (the ``reason`` label of ``fedpart_refused_total``).
UNKNOWN_TOKEN = "unknown_token"
CERTIFICATE = "certificate"
HELD = "credential_held"        # a live process holds the credential (or the client ids)
STILL_HELD = "credential_silent"  # the holder is silent but not yet gone: try again later
BAD_JOIN = "bad_join"           # ids out of range, not the credential's, protocol
REVOKED = "revoked"


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:127.0.0.1:5555`` -> ``ipv4:127.0.0.1``)."""
    return peer.rpartition(":")[0] if peer.count(":") >= 2 else peer


@dataclass
class _Subject:
    """Recent events of one credential or peer host."""

    events: deque[float] = field(default_factory=deque)
    peers: Counter[str] = field(default_factory=Counter)
    lines: deque[float] = field(default_factory=deque)
    alerted_at: float = float("-inf")


class AdmissionLog:
    """Refusals and takeovers: logged with their peer, counted, and alerted on when they pile up.
    Safe to call from any thread."""

    def __init__(self, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.log = Log.of(log)
        self.clock = clock
        self.refused: Counter[str] = Counter()  # by kind
        self.takeovers = 0
        self.alerts = 0
        self._subjects: dict[str, _Subject] = {}
        self._lock = threading.Lock()

    def refusal(self, kind: str, subject: str, peer: str, line: str) -> None:
        """A call or join of ``subject`` from ``peer`` was refused (``line`` says why)."""
        with self._lock:
            self.refused[kind] += 1
        self._event(subject, peer, f"refused {line} (from {peer})")

    def takeover(self, subject: str, peer: str, line: str) -> None:
        """A join from ``peer`` took over a session of ``subject`` whose process was gone."""
        with self._lock:
            self.takeovers += 1
        self._event(subject, peer, f"{line} (from {peer})")

    def _event(self, subject: str, peer: str, line: str) -> None:
        now = self.clock()
        with self._lock:
            state = self._subjects.setdefault(subject, _Subject())
            _forget(state.events, now)
            _forget(state.lines, now)
            state.events.append(now)
            state.peers[peer_host(peer)] += 1
            say = len(state.lines) < LINES_PER_WINDOW
            if say:
                state.lines.append(now)
            alert = len(state.events) >= ALERT_AT and now - state.alerted_at >= WINDOW_SECONDS
            if alert:
                state.alerted_at = now
                self.alerts += 1
                peers = ", ".join(f"{host} ({count})" for host, count in state.peers.most_common(5))
                count = len(state.events)
                state.peers.clear()
        if say:
            self.log.warning(line)
        if alert:
            self.log(f"alert: {subject}: {count} refused joins, refused calls or takeovers in the last "
                     f"{WINDOW_SECONDS:.0f} s, from {peers}; a client command started twice or a stolen token: "
                     "stop the second process, or revoke the credential in the credentials file (the server "
                     "re-reads it); further refusals of it are counted, not logged")


def _forget(events: deque[float], now: float) -> None:
    while events and now - events[0] > WINDOW_SECONDS:
        events.popleft()
