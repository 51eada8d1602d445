"""The exit codes of ``fedpart server``, ``fedpart client`` and ``fedpart run`` (docs/operating-a-run.md, "Exit
codes"), and how a process turns SIGINT / SIGTERM into an orderly stop: raised at once in the
main thread (:func:`stop_on_signals`: the launcher, and every command until it starts its work),
or handed to the program, which stops at a point of its choosing (:func:`signals_to` with a
:class:`StopRequest` or a :class:`StoppableCondition`: the client and the server).

A supervisor (systemd, Kubernetes, a shell script) tells from the code alone how a process ended:

====  ============  ============================================================================
code  name          meaning
====  ============  ============================================================================
0     COMPLETED     the run completed (server: every round and the final evaluation, no failure)
1     ERROR         an unexpected error, or a client process that cannot go on (its data, a
                    custom component), after telling the server why
2     USAGE         the command cannot run as given: a bad config or option, a missing dataset
                    file, a run directory that exists, an address already in use; nothing was
                    started or written
3     FAILURES      the run completed but with failures (results refused or lost, clients that
                    left, evaluations missing); ``summary.json`` lists them
4     UNREACHABLE   gave up waiting for the other side: a client found no server within
                    ``--connect-timeout`` (or lost it for ``--reconnect-timeout``); the server
                    saw the run's clients not hosted within ``server.join_timeout``
5     ENDED_EARLY   client: the server ended the run early (it was interrupted or gave up)
130   INTERRUPTED   SIGINT (Ctrl-C): stopped in order (a client leaves, a server writes what it
                    knows marked ``interrupted`` and can be resumed)
143   TERMINATED    SIGTERM: as SIGINT
====  ============  ============================================================================
"""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum


class ExitCode(IntEnum):
    COMPLETED = 0
    ERROR = 1
    USAGE = 2
    FAILURES = 3
    UNREACHABLE = 4
    ENDED_EARLY = 5
    INTERRUPTED = 128 + signal.SIGINT
    TERMINATED = 128 + signal.SIGTERM


# What a stop by each signal is called (a client's ``Leave`` reason, the summary's status note).
SIGNAL_REASONS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived: unwind, stop in order, exit with :attr:`code`.

    A ``BaseException`` like ``KeyboardInterrupt``, so that ``except Exception`` handlers on the
    way out do not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(SIGNAL_REASONS[signum])
        self.signum = signum
        self.reason = SIGNAL_REASONS[signum]
        self.code = ExitCode(128 + signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block the first SIGINT or SIGTERM raises :class:`Stopped` in the main thread;
    later ones are ignored, so the orderly stop (bounded: a client's ``Leave``, a server's summary
    and goodbye to its clients) is not cut short. SIGKILL still ends the process at once. The
    previous handlers come back when the block ends. Call from the main thread."""
    previous = {signum: signal.getsignal(signum) for signum in SIGNAL_REASONS}

    def stop(signum: int, frame) -> None:
        for other in SIGNAL_REASONS:
            signal.signal(other, signal.SIG_IGN)
        raise Stopped(signum)

    for signum in SIGNAL_REASONS:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def signals_to(stop: Callable[[Stopped], None]) -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise nothing: a thread of their own hands the first
    one to ``stop`` (as a :class:`Stopped`; later ones are ignored), and the program stops at a
    point of its choosing. An exception raised by a signal handler lands between any two
    bytecodes of the main thread, even between a lock's acquire and the ``with`` that would
    release it, and a lock left held stops the other threads for good. The handlers and the
    wakeup descriptor of before come back when the block ends. Outside the main thread (a
    program embedding fedpart), where no handler can be set, the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = {signum: signal.signal(signum, _noted) for signum in SIGNAL_REASONS}
    relay = threading.Thread(target=_relay, args=(reader, stop), name="signals", daemon=True)
    relay.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        writer.close()  # the relay reads the end of the stream and returns
        relay.join()
        reader.close()


def _noted(signum: int, frame: object) -> None:
    """The handler within :func:`signals_to`: the C handler has written ``signum`` to the
    wakeup descriptor already; nothing is raised here."""


def _relay(reader: socket.socket, stop: Callable[[Stopped], None]) -> None:
    """Read the numbers of the signals that arrived; hand the first SIGINT or SIGTERM to ``stop``."""
    while data := reader.recv(64):
        for signum in data:
            if signum in SIGNAL_REASONS:
                stop(Stopped(signum))
                return


class StopRequest:
    """A stop handed over (:func:`signals_to`), to be taken where the program chooses: the first
    :meth:`take` after :meth:`stop` raises it, once; :meth:`settle` drops a stop that would come
    too late (the work is done). ``arrived`` completes with the stop, for waits on futures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop: Stopped | None = None
        self._settled = False
        self.arrived: concurrent.futures.Future[Stopped] = concurrent.futures.Future()

    def stop(self, stop: Stopped) -> bool:
        """Ask for ``stop``; False when settled (stopped already, or :meth:`settle` was called)."""
        with self._lock:
            if self._settled or self._stop is not None:
                return False
            self._stop = stop
        self.arrived.set_result(stop)
        return True

    def settle(self) -> None:
        """From now on a stop is ignored."""
        with self._lock:
            self._settled, self._stop = True, None

    def take(self) -> None:
        """Raise the stop asked for, if any (once)."""
        with self._lock:
            stop, self._stop = self._stop, None
            if stop is not None:
                self._settled = True
        if stop is not None:
            raise stop


class StoppableCondition(threading.Condition):
    """A condition variable whose waits a stop ends: after :meth:`stop` (from any thread) the next
    :meth:`wait` raises the :class:`Stopped`, once (:class:`StopRequest`). Every wait of a
    program's main loop on it is then a point where the program stops in order."""

    def __init__(self) -> None:
        super().__init__()
        self.request = StopRequest()

    def stop(self, stop: Stopped) -> None:
        """Wake the waits; the next one raises ``stop`` (see :meth:`StopRequest.stop`)."""
        if self.request.stop(stop):
            with self:
                self.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        self.request.take()
        woken = super().wait(timeout)
        self.request.take()
        return woken
