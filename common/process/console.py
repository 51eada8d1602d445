"""What the server, the client processes and ``fedpart run`` print: one log-line format, and a
live progress display on a terminal.

- Every log line starts with the local time to the second (:func:`stamp`), in the server, the
  clients and the launcher alike.
- On a terminal a :class:`Display` keeps a live view (``rich``) below the log lines: the server's
  round, clients done of those sampled, bytes so far and the ETA (:func:`render_run`); a client
  process's current task and local step (:func:`render_client`). Elsewhere (CI, a log file, a
  pipe) it prints the log lines and nothing else: no escape codes.
- ``fedpart run`` reads the server's output through a pipe, so the server cannot see the
  launcher's terminal: asked with ``--progress json``, it prints its progress as
  machine-readable lines (:meth:`RunProgress.line`, every :data:`PROGRESS_SECONDS` while it
  changes), which the launcher parses (:meth:`RunProgress.parse`) and renders itself.

Log lines are stdlib :mod:`logging` records of the ``fedpart`` logger (``fedpart.server``,
``fedpart.client``, ``fedpart.launcher``), at the level their writer gives as an argument
(``display.log(text, level=...)``; a component's :class:`Log`: ``log(text)``, ``log.warning(text)``,
``log.error(text)``); a WARNING's line reads ``warning: ...`` and an ERROR's ``error: ...``
(:func:`with_level`), so that the level shows in the text too. The :data:`DISPLAY_HANDLER` on the
``fedpart`` logger prints each through the display that logged it, so the live view stays below
them; the records do not propagate to the root logger. ``--quiet`` / ``--verbose`` set the logger's
level (:func:`set_log_level`; the processes a command starts inherit it through
:data:`LOG_LEVEL_ENV`). A program that embeds fedpart may add its own handlers to the ``fedpart``
logger, and remove :data:`DISPLAY_HANDLER` to take the lines over.

``rich`` is imported only when a live view starts, so a command's ``--help`` stays light.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import IO, Any

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
PROGRESS_PREFIX = "fedpart-progress "
PROGRESS_SECONDS = 0.5  # how often a progress line or the live view is refreshed
PROGRESS_MODES = ("auto", "plain", "json")  # --progress: live on a terminal, plain lines, machine lines
LOGGER = "fedpart"
LOG_LEVEL_ENV = "FEDPART_LOG_LEVEL"  # set by --quiet / --verbose, read by the processes a command starts
LOG_LEVELS = {"quiet": logging.WARNING, "normal": logging.INFO, "verbose": logging.DEBUG}


def stamp(message: str) -> str:
    """A log line: local time to the second, then the message."""
    return f"{time.strftime(TIME_FORMAT)} {message}"


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is an interactive terminal that can show a live view."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass(frozen=True)
class RunProgress:
    """Where a run stands, as the round engine knows it (``Coordinator.progress``).

    ``stage`` is ``joining`` (waiting for the clients to be hosted: ``done`` of ``total``
    clients ready), ``training`` (round ``round``: ``done`` of the ``total`` sampled clients
    answered) or ``evaluating`` (the final evaluation: ``done`` of ``total`` clients). Bytes are
    the run's totals so far; ``eta_seconds`` is the mean time of the rounds completed so far times
    the rounds left (None before the first round completes).
    """

    stage: str
    round: int
    rounds: int
    done: int
    total: int
    bytes_down: int
    bytes_up: int
    eta_seconds: float | None = None

    def line(self) -> str:
        """The machine-readable progress line (``--progress json``)."""
        return PROGRESS_PREFIX + json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, line: str) -> RunProgress | None:
        """The progress a line carries, or None for any other line."""
        if not line.startswith(PROGRESS_PREFIX):
            return None
        try:
            return cls(**json.loads(line[len(PROGRESS_PREFIX):]))
        except (ValueError, TypeError):
            return None


@dataclass
class ClientActivity:
    """What a client process is doing now (shown live on a terminal). Plain attribute writes:
    the training loop's step callback costs an assignment."""

    doing: str = "starting"
    step: int = 0
    steps: int = 0

    def task(self, doing: str, steps: int = 0) -> None:
        self.doing, self.step, self.steps = doing, 0, steps

    def advance(self, step: int, steps: int) -> None:
        """The training loop's progress callback: ``step`` of ``steps`` local steps done."""
        self.step, self.steps = step, steps


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def render_run(progress: RunProgress | None) -> Any:
    """The server's live view (a ``rich`` renderable)."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    if progress is None:
        grid.add_row("starting ...")
        return grid
    if progress.stage == "joining":
        grid.add_row("waiting for clients", ProgressBar(progress.total, progress.done, width=30),
                     f"{progress.done}/{progress.total} ready")
        return grid
    completed = progress.round - 1 if progress.stage == "training" else progress.rounds
    eta = "-" if progress.eta_seconds is None else format_seconds(progress.eta_seconds)
    grid.add_row(f"round {progress.round}/{progress.rounds}" if progress.stage == "training" else "rounds done",
                 ProgressBar(progress.rounds, completed, width=30), f"eta {eta}")
    label = "clients" if progress.stage == "training" else "final evaluation"
    grid.add_row(label, ProgressBar(max(progress.total, 1), progress.done, width=30),
                 f"{progress.done}/{progress.total} done")
    grid.add_row("bytes so far", "", f"down {progress.bytes_down / 1e6:,.1f} MB  up {progress.bytes_up / 1e6:,.1f} MB")
    return grid


def render_client(activity: ClientActivity) -> Any:
    """A client process's live view (a ``rich`` renderable)."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    if activity.steps:
        grid.add_row(activity.doing, ProgressBar(activity.steps, activity.step, width=30),
                     f"step {activity.step}/{activity.steps}")
    else:
        grid.add_row(activity.doing)
    return grid


def with_level(message: str, level: int = logging.INFO) -> str:
    """``message`` as a line of ``level`` reads: ``error: ...`` from ERROR up, ``warning: ...``
    for a WARNING, as it is below."""
    if level >= logging.ERROR:
        return f"error: {message}"
    if level >= logging.WARNING:
        return f"warning: {message}"
    return message


class DisplayHandler(logging.Handler):
    """Prints ``fedpart`` log records as stamped lines: through the :class:`Display` that logged
    one (above its live view), else on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = stamp(self.format(record))
            display = getattr(record, "display", None)
            if display is not None:
                display.print(line)
            else:
                print(line, file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging must not raise; the handler reports it
            self.handleError(record)


DISPLAY_HANDLER = DisplayHandler()
logging.getLogger(LOGGER).addHandler(DISPLAY_HANDLER)
# not also through the root logger: a library that configures it (Opacus calls basicConfig) would
# print every line twice; a program that embeds fedpart adds its handlers to the fedpart logger
logging.getLogger(LOGGER).propagate = False
logging.getLogger(LOGGER).setLevel(LOG_LEVELS.get(os.environ.get(LOG_LEVEL_ENV, ""), logging.INFO))


def set_log_level(name: str) -> None:
    """Set the ``fedpart`` logger to ``name`` (:data:`LOG_LEVELS`), here and in the processes this
    one starts."""
    logging.getLogger(LOGGER).setLevel(LOG_LEVELS[name])
    os.environ[LOG_LEVEL_ENV] = name


class Display:
    """Log lines, with a live view below them while the output is a terminal.

    ``view`` (settable until the block starts) builds the live view's renderable; it is called a
    few times a second from rich's refresh thread. Without a terminal (or without ``view``) the
    display prints plain lines only. Use as a context manager: the live view runs inside the block.
    """

    def __init__(self, view: Callable[[], Any] | None = None, stream: IO[str] | None = None,
                 logger: str = LOGGER) -> None:
        self.stream = stream or sys.stdout
        self.view = view
        self.logger = logging.getLogger(logger)
        self._live_view = None
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        """Whether the display shows a live view (a view on a terminal)."""
        return self.view is not None and is_terminal(self.stream)

    def __enter__(self) -> Display:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, highlight=False, markup=False, emoji=False, soft_wrap=True)
            live_view = Live(get_renderable=self.view, console=console, transient=True,
                             refresh_per_second=1 / PROGRESS_SECONDS)
            live_view.start()
            with self._lock:
                self._live_view = live_view
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            live_view, self._live_view = self._live_view, None
        if live_view is not None:
            live_view.stop()

    def print(self, text: str) -> None:
        """Print ``text`` as it is (above the live view while there is one)."""
        with self._lock:
            if self._live_view is not None:
                self._live_view.console.print(text)
            else:
                print(text, file=self.stream, flush=True)

    def log(self, message: str, source: str = "", level: int = logging.INFO) -> None:
        """Log ``message`` at ``level``, prefixed with ``source`` (``[client NAME] warning: ...``:
        :func:`with_level`); :data:`DISPLAY_HANDLER` prints it here, stamped (:func:`stamp`)."""
        self.logger.log(level, f"{source}{with_level(message, level)}", extra={"display": self})

    def warning(self, message: str, source: str = "") -> None:
        self.log(message, source, logging.WARNING)

    def error(self, message: str, source: str = "") -> None:
        self.log(message, source, logging.ERROR)


class Log:
    """A component's log, the level an argument: ``log(text)`` at INFO, ``log.warning(text)``,
    ``log.error(text)``, ``log(text, level)``. It logs through a :class:`Display` (``source``
    before each line), or writes each line as the display prints it (``warning: ...``) to a plain
    ``write(line)``: ``print``, or a list's ``append`` in a test."""

    def __init__(self, write: Callable[[str], None] | Display = print, source: str = "") -> None:
        self._display = write if isinstance(write, Display) else None
        self._write = write
        self.source = source

    @classmethod
    def of(cls, target: Log | Display | Callable[[str], None]) -> Log:
        """``target`` as a :class:`Log` (a Log is its own)."""
        return target if isinstance(target, Log) else cls(target)

    def __call__(self, message: str, level: int = logging.INFO) -> None:
        if self._display is not None:
            self._display.log(message, self.source, level)
        else:
            self._write(f"{self.source}{with_level(message, level)}")

    def warning(self, message: str) -> None:
        self(message, logging.WARNING)

    def error(self, message: str) -> None:
        self(message, logging.ERROR)


class ProgressLines:
    """``--progress json``: a thread that prints ``source()`` as a progress line every
    :data:`PROGRESS_SECONDS` while it changes. Use as a context manager."""

    def __init__(self, source: Callable[[], RunProgress], display: Display) -> None:
        self._source = source
        self._display = display
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-lines", daemon=True)

    def __enter__(self) -> ProgressLines:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = None
        while not self._stop.wait(PROGRESS_SECONDS):
            progress = self._source()
            if progress != last:
                self._display.print(progress.line())
                last = progress
