"""The process registry: which client processes are connected, which clients each hosts, and
whether they are still there.

A process *joins* with the client ids it hosts and gets a session; every later call names that
session and is honoured only with the credential that opened it. With credentials a process hosts
exactly the ids its credential names. One live process per credential (on an open server: per
client id): a join for a credential that another process holds is

- refused (:class:`~fedpart.common.wire.protocol.Held`, the client exits with code 2) while the holder
  is connected: a long poll of it waits, a result of it is on the wire, or while it trains a
  heartbeat the server holds open;
- taken (a *take-over*: the holder is gone, its tasks move to the new process) once the holder's
  connection closed with such a call cut short and nothing was heard from it since (a process
  killed and started again), or once it was silent for ``server.heartbeat_timeout`` and reaped;
- told to try again (:class:`~fedpart.common.wire.protocol.NotYet`) in between: the holder is silent
  but not gone yet (it may be loading its data, or stopped).

So the same command started twice, or a stolen token presented beside the live process, is refused
with the holder's address, and never takes sessions over in a loop. Every refusal and take-over is
logged at warning with the peer's address, counted, and alerted on when it repeats
(:class:`~fedpart.server.transport.admission.AdmissionLog`). A process is *ready* once it loaded its data and
asked for work; the number of ready clients is a running count.

Liveness: a process is alive while a call of it is open (a long poll, or a heartbeat the server
holds), and for ``server.heartbeat_timeout`` after it was last heard from. A silent process is
*reaped*: looked for when another process joins for its clients, and by a scan at most every
:data:`REAP_INTERVAL_SECONDS` while the round loop waits. A process that leaves, is reaped or is
taken over is reported to the task board (:class:`ProcessEvents`), which closes its tasks. At the
end every live process is *released* (told the run is over).

The registry shares the round engine's condition variable (one lock for the whole state
machine). The calls of a process (join, leave, heartbeat) and the waits take it; the lookups and
the signs of life a poll gives (``session``, ``process``, ``host``, ``polled``, ``waiting``,
``release``) are for the task board and the engine, which call them with the lock held.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fedpart.common.process.console import Log
from fedpart.common.wire.client_ids import format_id_ranges
from fedpart.common.config.run_config import ServerConfig
from fedpart.common.wire.plans import JoinInfo, RunOutcome
from fedpart.common.wire.protocol import PROTOCOL_VERSION, BadJoin, Denied, Held, NotYet, Rejected
from fedpart.common.wire.security import Principal
from fedpart.server.transport.admission import BAD_JOIN, HELD, REVOKED, STILL_HELD, AdmissionLog
from fedpart.server.policy.validation import printable

# Silent processes are looked for at most this often (a scan over the live processes); also the
# longest the round loop sleeps between looks at its deadline.
REAP_INTERVAL_SECONDS = 1.0


@dataclass(eq=False)
class ProcessState:
    """One connected client process."""

    session: str
    name: str
    clients: list[int]
    last_seen: float
    peer: str = ""                      # the address its join came from
    principal: Principal | None = None  # the credential it joined with (None: open server)
    joined: float = 0.0
    alive: bool = True
    ready: bool = False     # has loaded its data and asked for work
    open_calls: int = 0     # its long polls and held heartbeats now open: it is connected
    disconnected: bool = False  # such a call was cancelled (its connection closed) and nothing came since
    released: bool = False  # has been told the run is over

    @property
    def connected(self) -> bool:
        """A long poll or a held heartbeat of it is open: alive, however long that takes."""
        return self.open_calls > 0

    @property
    def holds(self) -> str:
        """What it holds, for log lines: its credential, or on an open server its client ids."""
        if self.principal is not None:
            return f"credential {self.principal.name!r}"
        return f"client ids {format_id_ranges(self.clients)}"


class ProcessEvents(Protocol):
    """What the task board hears from the registry (called with the lock held)."""

    def process_restarted(self, old: ProcessState, new: ProcessState) -> None: ...

    def process_gone(self, process: ProcessState) -> None: ...


class ProcessRegistry:
    """Client processes, their sessions and the clients they host."""

    def __init__(self, clients: int, server: ServerConfig, cond: threading.Condition,
                 log: Callable[[str], None]) -> None:
        """The registry of a run of ``clients`` clients, under ``server``'s heartbeat and join timeouts."""
        self.clients = clients
        self.heartbeat_timeout = server.heartbeat_timeout
        self.join_timeout = server.join_timeout
        self.log = Log.of(log)
        self.admission = AdmissionLog(log)
        self.events: ProcessEvents | None = None  # the task board, once it exists
        self.done = False                         # the run is over: no joins, polls answer DONE
        self.outcome = RunOutcome.COMPLETED       # how it ended, told with DONE
        self._cond = cond
        self._processes: dict[str, ProcessState] = {}
        self._by_credential: dict[str, str] = {}  # credential name -> session of its latest process
        self._host: dict[int, str] = {}          # client id -> session of the process hosting it
        self._ready_clients = 0                  # clients hosted by a live process that asked for work
        self._last_reap = 0.0
        self._unreleased: set[str] = set()       # live processes not yet told the run is over
        self._left: list[str] = []               # processes that said why they stopped

    # ------------------------------------------------------------------ calls of a process

    def join(self, request: JoinInfo, principal: Principal | None = None, peer: str = "") -> ProcessState:
        """Register a client process and the clients it hosts; raises :class:`Rejected` (or one of
        its kinds: :class:`BadJoin`, :class:`Denied`, :class:`Held`, :class:`NotYet`) and changes
        nothing when the join breaks a rule. Every refusal is logged with ``peer``."""
        name = printable(request.process_name)
        subject = f"credential {principal.name!r}" if principal is not None else peer or name
        try:
            process = self._join(request, principal, peer, name)
        except Rejected as error:
            kind = HELD if isinstance(error, Held) else STILL_HELD if isinstance(error, NotYet) else BAD_JOIN
            self.admission.refusal(kind, subject, peer, f"the join of {name}: {error}")
            raise
        self.log(f"joined: {name} hosts clients {format_id_ranges(process.clients)}"
                 + (f" ({peer})" if peer else ""))
        return process

    def _join(self, request: JoinInfo, principal: Principal | None, peer: str, name: str) -> ProcessState:
        if request.protocol != PROTOCOL_VERSION:
            raise BadJoin(f"protocol version {request.protocol} is not supported (server speaks {PROTOCOL_VERSION}): "
                          "run the same fedpart version on the server and the clients")
        ids = request.client_ids
        if not ids:
            raise BadJoin("a client process must host at least one client")
        if len(set(ids)) != len(ids):
            raise BadJoin(f"duplicate client ids in one process: {ids}")
        bad = [i for i in ids if i >= self.clients]
        if bad:
            raise BadJoin(f"client ids {format_id_ranges(bad)} are not in the run: it has clients 0-{self.clients - 1}")
        if principal is not None:
            if not set(ids) <= principal.clients:
                raise Denied(f"credential {principal.name!r} may not host clients "
                             f"{format_id_ranges(set(ids) - principal.clients)}; it names "
                             f"{format_id_ranges(principal.clients)}")
            unhosted = principal.clients - set(ids)
            if unhosted:
                raise BadJoin(f"credential {principal.name!r} names clients {format_id_ranges(principal.clients)}; "
                              f"this process hosts {format_id_ranges(ids)}, so clients {format_id_ranges(unhosted)} "
                              f"would be hosted by no process (one process per credential): give --clients "
                              f"{format_id_ranges(principal.clients)}")
        with self._cond:
            if self.done:
                raise Rejected("the run is over")
            now = time.monotonic()
            holders = {self._processes[self._host[i]] for i in ids if i in self._host}
            if principal is not None and principal.name in self._by_credential:
                holders.add(self._processes[self._by_credential[principal.name]])
            for holder in holders:
                self._reap_if_silent(holder, now)
            holders = sorted((p for p in holders if p.alive), key=lambda p: p.joined)
            for holder in holders:
                self._check_gone(holder, principal, now)
            process = ProcessState(uuid.uuid4().hex, name, ids, now, peer, principal, joined=now)
            for old in holders:
                self._take_over(old, process)
            self._processes[process.session] = process
            if principal is not None:
                self._by_credential[principal.name] = process.session
            for client in ids:
                self._host[client] = process.session
        return process

    def _check_gone(self, holder: ProcessState, principal: Principal | None, now: float) -> None:
        """Raise unless ``holder``, a live process holding what a join asks for, may be taken over:
        :class:`Held` while it is connected, :class:`NotYet` while it is silent but not gone."""
        if principal is not None and holder.principal != principal:
            raise Held(f"{holder.holds} hosts some of these clients")
        if holder.disconnected:
            return
        what = f"{holder.holds} {'is' if holder.principal is not None else 'are'}"
        heard = now - holder.last_seen
        if holder.connected:
            raise Held(f"{what} held by a live process, {holder.name} at {holder.peer or 'an unknown address'} "
                       f"(joined {now - holder.joined:.0f} s ago, connected now): one live process per "
                       f"{'credential' if holder.principal is not None else 'client id'}; stop that process first "
                       f"(a command started twice?), or if it is not yours, revoke the credential")
        free_in = self.heartbeat_timeout - heard
        raise NotYet(f"{what} held by {holder.name} at {holder.peer or 'an unknown address'}, silent for "
                     f"{heard:.0f} s; it is freed once silent for server.heartbeat_timeout "
                     f"({self.heartbeat_timeout:.0f} s), in {max(free_in, 0.0):.0f} s")

    def leave(self, session: str, reason: str, principal: Principal | None = None) -> None:
        """A process that cannot go on: its clients become unavailable and the reason is kept."""
        reason = printable(reason)
        with self._cond:
            process = self.session(session, principal)
            if process is None:
                return
            self._left.append(f"process {process.name} (clients {format_id_ranges(process.clients)}) left: {reason}")
            self._gone(process)
        self.log.error(f"client process {process.name} left: {reason}")

    def revoke(self, revoked: set[Principal]) -> list[ProcessState]:
        """Drop the live processes that joined with a ``revoked`` credential (their clients become
        unavailable, their tasks close); returns them."""
        with self._cond:
            dropped = [p for p in self._processes.values() if p.alive and p.principal in revoked]
            for process in dropped:
                self._gone(process)
        for process in dropped:
            self.admission.refusal(REVOKED, f"credential {process.principal.name!r}", process.peer,
                                   f"{process.name}: its credential {process.principal.name!r} was revoked; clients "
                                   f"{format_id_ranges(process.clients)} are unavailable until a credential names "
                                   "them again")
        return dropped

    def heartbeat(self, session: str, principal: Principal | None = None) -> bool:
        """A sign of life; False for a session the caller does not hold."""
        with self._cond:
            process = self.session(session, principal)
            if process is None:
                return False
            process.last_seen = time.monotonic()
            process.disconnected = False
            return True

    def polled(self, process: ProcessState) -> None:
        """A poll of ``process`` arrived: it is alive, and ready for work (holds the lock)."""
        process.last_seen = time.monotonic()
        process.disconnected = False
        if not process.ready:
            process.ready = True
            self._ready_clients += len(process.clients)
            if self._ready_clients >= self.clients:
                self._cond.notify_all()

    @staticmethod
    def waiting(process: ProcessState, waiting: bool, cancelled: bool = False) -> None:
        """A call that shows ``process`` connected (a long poll, a held heartbeat) starts or ends;
        its end is a sign of life, unless it was ``cancelled``: its connection closed (the process
        died, or its link broke and it will call again), and a join with its credential may take
        over until it calls again (holds the lock)."""
        if waiting:
            process.open_calls += 1
            return
        process.open_calls -= 1
        process.last_seen = time.monotonic()
        process.disconnected = cancelled

    def hold(self, session: str, principal: Principal | None) -> ProcessState | None:
        """A heartbeat of ``session`` that the server holds open, or a result stream of it, starts
        (see :meth:`waiting`); None when the caller does not hold the session."""
        with self._cond:
            process = self.session(session, principal)
            if process is not None:
                self.waiting(process, True)
            return process

    def unhold(self, process: ProcessState, cancelled: bool) -> None:
        """A held heartbeat or a result stream ended: its time was up or the result came whole, or
        it was ``cancelled`` (cut short by its connection closing, see :meth:`waiting`)."""
        with self._cond:
            self.waiting(process, False, cancelled)

    # ------------------------------------------------------------------ lookups (hold the lock)

    def session(self, session: str, principal: Principal | None) -> ProcessState | None:
        """The live process of ``session``, if the caller holds the credential it joined with."""
        process = self._processes.get(session)
        if process is None or not process.alive or process.principal != principal:
            return None
        return process

    def process(self, session: str) -> ProcessState | None:
        """The process of ``session``, alive or not."""
        return self._processes.get(session)

    def host(self, client_id: int) -> ProcessState | None:
        """The live process hosting ``client_id``, if any."""
        session = self._host.get(client_id)
        process = self._processes[session] if session is not None else None
        return process if process is not None and process.alive else None

    @property
    def left(self) -> list[str]:
        """Why processes that said so stopped."""
        with self._cond:
            return list(self._left)

    # ------------------------------------------------------------------ liveness

    def reap_silent(self) -> None:
        """Mark processes silent for longer than the heartbeat timeout as gone (a scan over the
        processes, at most every :data:`REAP_INTERVAL_SECONDS`)."""
        with self._cond:
            now = time.monotonic()
            if now - self._last_reap < REAP_INTERVAL_SECONDS:
                return
            self._last_reap = now
            for process in list(self._processes.values()):
                self._reap_if_silent(process, now)

    def wait_for_clients(self) -> None:
        """Block until every client id is hosted by a live process that has loaded its data and
        asked for work (``server.join_timeout``), so that round 1 measures training, not start-up."""
        deadline = time.monotonic() + self.join_timeout
        with self._cond:
            while True:
                self.reap_silent()
                if self._ready_clients >= self.clients:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [c for c in range(self.clients) if not ((host := self.host(c)) and host.ready)]
                    reasons = "".join(f"; {line}" for line in self._left)
                    raise TimeoutError(f"after {self.join_timeout:.0f} s clients {format_id_ranges(missing)} "
                                       f"are still not hosted by a ready client process{reasons}")
                self._cond.wait(min(remaining, REAP_INTERVAL_SECONDS))

    # ------------------------------------------------------------------ the end of the run

    @property
    def live_processes(self) -> int:
        """Connected processes (counted: call it once a round, not per call)."""
        with self._cond:
            return sum(process.alive for process in self._processes.values())

    @property
    def ready_clients(self) -> int:
        """Clients hosted by a live process that has loaded its data and asked for work."""
        with self._cond:
            return self._ready_clients

    def finish(self, outcome: RunOutcome = RunOutcome.COMPLETED) -> None:
        """The run is over (``outcome`` says how): joins are refused, and every live process is
        to be released."""
        with self._cond:
            self.done = True
            self.outcome = outcome
            self._unreleased = {s for s, p in self._processes.items() if p.alive and not p.released}
            self._cond.notify_all()

    def release(self, process: ProcessState) -> None:
        """The process was told the run is over, or is gone (holds the lock)."""
        process.released = True
        if process.session in self._unreleased:
            self._unreleased.discard(process.session)
            if not self._unreleased:
                self._cond.notify_all()

    def wait_until_released(self, timeout: float) -> bool:
        """Wait (bounded) until every live process has been told the run is over."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self.reap_silent()
                if not self._unreleased:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, REAP_INTERVAL_SECONDS))

    # ------------------------------------------------------------------ helpers (hold the lock)

    def _take_over(self, old: ProcessState, new: ProcessState) -> None:
        """A process replaces its predecessor, which is gone (the board moves its queued tasks)."""
        if self.events is not None:
            self.events.process_restarted(old, new)
        self._gone(old)
        subject = f"credential {old.principal.name!r}" if old.principal is not None else new.peer or new.name
        self.admission.takeover(subject, new.peer, f"{new.name} took over {old.holds} from {old.name} at "
                                                   f"{old.peer or 'an unknown address'}, whose connection had closed")

    def _gone(self, process: ProcessState) -> None:
        """A process is no longer there: its clients become unavailable, its tasks close."""
        if not process.alive:
            return
        process.alive = False
        if process.ready:
            self._ready_clients -= len(process.clients)
        if self.events is not None:
            self.events.process_gone(process)
        self.release(process)

    def _reap_if_silent(self, process: ProcessState, now: float) -> None:
        if process.alive and not process.connected and now - process.last_seen > self.heartbeat_timeout:
            self._gone(process)
            self.log.warning(f"process {process.name} went silent; its clients are unavailable")
