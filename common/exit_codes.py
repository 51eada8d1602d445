"""The exit codes of ``fedpart server``, ``fedpart client`` and ``fedpart run`` (docs/operating-a-run.md, "Exit
codes"), and how a process turns SIGINT / SIGTERM into an orderly stop.

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

import signal
from collections.abc import Iterator
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
