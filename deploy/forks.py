"""The processes ``fedpart run`` starts, forked from a fork server that has imported torch.

Importing torch costs a Python process over a second of CPU, and a local run starts a server and
every client process at once, each importing it. The launcher instead starts Python's fork
server (:mod:`multiprocessing`, the ``forkserver`` start method) with torch preloaded, once its
checks have passed, and forks each server and client process from it. The fork server has done
nothing but import torch: no thread of its own survives a fork, no CUDA context and no gRPC
state exist in it, so each forked process starts as a fresh ``python -m fedpart`` would, with
torch already imported, and runs the ``fedpart`` command it is given (:func:`run_command`) with
the environment, output and exit code that command would have. Each is stopped by its PID like
any process (:class:`ForkedProcess` offers the part of :class:`subprocess.Popen` the launcher
uses); its name, where ``ps -o comm`` and ``top`` look, is ``fedpart-server`` or
``fedpart-client`` (its command line is the fork server's).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TextIO

Command = Callable[[list[str]], int]
"""The ``fedpart`` command's entry (:func:`fedpart.cli.main.main`), which a forked process runs
with its arguments: handed in by the command line, above this layer."""

PRELOADED = ["torch"]
"""What the fork server imports before it forks anything: what every server and client process
imports, and nothing that reads the environment at import time (gRPC does: each process imports
it itself)."""


def run_command(command: Command, args: list[str], output: Connection | str, env: dict[str, str]) -> None:
    """In a forked process: ``command(args)`` (``fedpart ARGS``) with environment ``env``, its
    standard output and error into ``output`` (the write end of the launcher's pipe, or a log
    file's path, appended to), line-buffered as ``PYTHONUNBUFFERED`` would have them; exits with
    the command's code."""
    _name_process(f"fedpart-{args[0]}")
    os.environ.clear()
    os.environ.update(env)
    if isinstance(output, Connection):
        target = os.dup(output.fileno())
        output.close()
    else:
        target = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.argv = [sys.argv[0], *args]
    gc.disable()  # as the ``fedpart`` command does (fedpart.cli.main.command)
    sys.exit(command(args))


def _name_process(name: str) -> None:
    """Give this process ``name`` (its first 15 bytes) where ``ps -o comm``, ``top`` and
    ``pgrep`` look (Linux; elsewhere nothing): forked processes share the fork server's command
    line."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    set_name = 15  # PR_SET_NAME, <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(set_name, name.encode()[:15], 0, 0, 0)


class ForkedProcess:
    """A process forked from the fork server, with the methods of :class:`subprocess.Popen` the
    launcher uses; ``stdout``: its output, where it goes to the launcher (else None)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdout: TextIO | None) -> None:
        self._process = process
        self.pid: int = process.pid
        self.stdout = stdout

    @property
    def returncode(self) -> int | None:
        """Its exit code (minus the signal's number where a signal ended it), None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts ``fedpart`` commands (``command``, with their arguments) as processes forked from one
    fork server with torch preloaded (the fork server starts at the first one and ends with this
    process)."""

    def __init__(self, command: Command) -> None:
        self._command = command
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOADED)

    def start(self, args: list[str], env: dict[str, str], log: Path | None = None) -> ForkedProcess:
        """``fedpart ARGS`` in a forked process: its output appended to ``log``, or, without one,
        readable as text from the returned process's ``stdout``."""
        if log is not None:
            process = self._context.Process(target=run_command, args=(self._command, args, str(log), env), daemon=True)
            process.start()
            return ForkedProcess(process, None)
        reader, writer = self._context.Pipe(duplex=False)
        process = self._context.Process(target=run_command, args=(self._command, args, writer, env), daemon=True)
        process.start()
        writer.close()
        stdout = open(os.dup(reader.fileno()), "r", encoding="utf-8", errors="backslashreplace")
        reader.close()
        return ForkedProcess(process, stdout)
