"""SIGINT / SIGTERM handed to the program instead of raised anywhere (common/process/exit_codes.py):
:func:`signals_to` and :class:`StoppableCondition`, the server's orderly stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from fedpart.common.process.exit_codes import StoppableCondition, Stopped

WAIT = 60.0


def test_a_stop_ends_the_next_wait_once() -> None:
    cond = StoppableCondition()
    raised: list[BaseException] = []
    waiting = threading.Event()

    def waiter() -> None:
        with cond:
            waiting.set()
            try:
                cond.wait(WAIT)
            except Stopped as stop:
                raised.append(stop)
            raised.append(cond.wait(0.01))  # taken once: this wait times out as any other

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(WAIT)
    started = time.monotonic()
    cond.stop(Stopped(signal.SIGTERM))
    thread.join(WAIT)
    assert time.monotonic() - started < WAIT / 2
    assert isinstance(raised[0], Stopped) and raised[0].signum == signal.SIGTERM and raised[0].code == 143
    assert raised[1] is False


def test_a_stop_before_the_wait_is_raised_by_it_and_later_stops_are_ignored() -> None:
    cond = StoppableCondition()
    cond.stop(Stopped(signal.SIGINT))
    cond.stop(Stopped(signal.SIGTERM))
    with cond:
        with pytest.raises(Stopped) as stopped:
            cond.wait(0)
        assert stopped.value.reason == "interrupted"
        cond.stop(Stopped(signal.SIGTERM))
        assert cond.wait(0) is False


def test_a_settled_condition_ignores_a_stop() -> None:
    cond = StoppableCondition()
    cond.request.settle()
    cond.stop(Stopped(signal.SIGINT))
    with cond:
        assert cond.wait(0) is False


# A main thread that takes a lock again and again while signals arrive: with the handlers of
# signals_to nothing is raised in it, the relay hands the first signal over, later ones are ignored,
# and the handlers of before are back after the block.
SIGNALLED_PROGRAM = """
import os, signal, sys, threading
from fedpart.common.process.exit_codes import StoppableCondition, signals_to

cond = StoppableCondition()
stops = []
def stop(stopped):
    stops.append(stopped.signum)
    cond.stop(stopped)

before = signal.getsignal(signal.SIGINT)
with signals_to(stop):
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
        os.kill(os.getpid(), signum)
    turns = 0
    try:
        while True:
            with cond:
                turns += 1
                cond.wait(0.001)
    except BaseException as error:
        caught = error
assert signal.getsignal(signal.SIGINT) is before
free = []
other = threading.Thread(target=lambda: free.append(cond.acquire(timeout=10)))
other.start(); other.join()
print(type(caught).__name__, int(caught.signum), stops, turns > 0, free)
"""


def test_signals_are_handed_to_the_program_and_raised_only_at_its_wait() -> None:
    done = subprocess.run([sys.executable, "-c", SIGNALLED_PROGRAM], capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr
    term = int(signal.SIGTERM)
    assert done.stdout.split() == ["Stopped", str(term), f"[{term}]", "True", "[True]"]


def test_a_stop_ends_a_clients_wait_for_its_session_and_cancels_the_call() -> None:
    import asyncio

    from fedpart.client.session import SessionThread

    loop = SessionThread()
    try:
        forever = loop.submit(asyncio.sleep(3600))
        threading.Timer(0.05, loop.stops.stop, args=(Stopped(signal.SIGINT),)).start()
        with pytest.raises(Stopped):
            loop.wait(forever)
        assert forever.cancelled()
        assert loop.call(asyncio.sleep(0, result="next")) == "next"  # taken once: the Leave still goes
    finally:
        loop.close()
