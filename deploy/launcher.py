"""``fedpart run``: one server and ``processes`` client processes on 127.0.0.1 (or one client
process per device of ``--devices``).

Everything is checked first, in this process, before any process starts: the whole config
(``fedpart.common.config.experiment.check_experiment``, with the clients' data and the server's own
needs on this machine), the devices of ``--devices``, and the run directory (an earlier run is
refused unless ``--overwrite``). The launcher then makes throw-away credentials for the run
(``fedpart certs`` into a private temporary directory, removed afterwards), so the local run uses
TLS and per-process tokens like a deployed one. The server and the client processes are forked
from a fork server that imported torch once (:mod:`fedpart.deploy.forks`; ``ps -o comm`` names
them ``fedpart-server`` and ``fedpart-client``) and run the ``fedpart server`` and ``fedpart
client`` commands. The server (whose threads yield to the clients' training,
``--yield-to-training``) listens on a free port and announces it on its first output line; the
launcher reads that line (bounded wait), starts the clients with an even share of the
client ids and of the CPU cores, each on its device (their output goes to
``<out>/logs/client_K.log``), forwards the server's output, and stops every process it started by
PID. On a terminal it shows the live progress display, rendered from the progress lines the server
prints with ``--progress json``; elsewhere it forwards plain lines only. A failed client process
makes the whole run fail. Exit codes: the server's (docs/operating-a-run.md, "Exit codes"); a client process's when
it failed first; 130 / 143 when the launcher was interrupted / terminated (its processes then stop
in order: the clients leave, the server writes what it knows marked ``interrupted``).
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedpart.client.placement import AUTO, resolve_devices
from fedpart.common.wire.client_ids import split_clients
from fedpart.common.config.run_config import RunConfig
from fedpart.common.process.console import Display, RunProgress, render_run, stamp
from fedpart.common.process.exit_codes import ExitCode, Stopped
from fedpart.deploy.forks import Command, ForkedProcess, ForkServer

STARTUP_SECONDS = 120.0
STOP_SECONDS = 30.0
_LISTENING = re.compile(r"listening on (\S+:\d+)")


def client_processes(config: RunConfig, devices: str | None) -> tuple[list[tuple[str, str]], list[str]]:
    """(client ids, device) of each client process ``fedpart run`` starts, and notes to print.

    Without ``devices``: ``processes`` processes on the CPU. With ``devices`` (``cuda:0,cuda:1``,
    a device repeated to share it, or ``auto``: every visible GPU) one process per device, and
    ``processes`` of the config is not used; ``auto`` where no GPU is visible falls back to
    ``processes`` processes on the CPU. Raises DeviceError (a ValueError) for a device that is not
    usable here, before anything starts.
    """
    notes = []
    chosen = resolve_devices(devices) if devices is not None else []
    if devices is not None and not chosen:
        notes.append(f"--devices {AUTO}: no GPU is visible; {config.processes} client process(es) on the CPU")
    if not chosen:
        return [(ids, "cpu") for ids in split_clients(config.clients, config.processes)], notes
    ranges = split_clients(config.clients, len(chosen))
    if len(ranges) < len(chosen):
        notes.append(f"--devices: {len(chosen)} devices for {config.clients} client(s); "
                     f"using {', '.join(chosen[:len(ranges)])}")
    if config.processes != len(ranges):
        notes.append(f"--devices: {len(ranges)} client process(es), one per device "
                     f"(processes: {config.processes} of the config is not used)")
    return list(zip(ranges, chosen)), notes


def _pump(stream, sink: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        sink.put(line)
    sink.put(None)


def stop_processes(processes: list[subprocess.Popen] | list[ForkedProcess],
                   grace_seconds: float = 10.0) -> None:
    """Terminate by PID, then kill whatever is still there after ``grace_seconds``."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_seconds
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def run_bounded(command: list[str], log_path: Path, timeout: float, cwd: Path | None = None) -> tuple[int | None, float]:
    """Run ``command`` (a whole ``fedpart run``, as the benchmark scripts do) in its own session,
    its output in ``log_path``. At ``timeout`` it is stopped by PID (SIGTERM: a launcher then stops
    its server and clients), and its process group killed if it has not ended within
    :data:`STOP_SECONDS`. Returns the exit code (None when it ran out of time) and the wall seconds."""
    started = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
    return code, time.perf_counter() - started


def failure(code: int | None, timeout: float, log_path: Path) -> str:
    """Why a :func:`run_bounded` command failed, with the last lines of its log."""
    reason = f"exit code {code}" if code is not None else f"no end within {timeout:.0f} s"
    return f"{reason}; last lines of {log_path}:\n{_tail(log_path, 15)}"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def resume_command(out: Path) -> str:
    """The command that continues the local run in ``out``."""
    return shlex.join(["fedpart", "run", "--resume", str(out.resolve())])


def _error(message: str) -> None:
    print(stamp(f"fedpart run: {message}"), file=sys.stderr, flush=True)


def run_local(config_path: Path, overrides: list[str], config: RunConfig, out_dir: str, command: Command,
              overwrite: bool = False, devices: str | None = None, metrics_port: int | None = None,
              resume: bool = False) -> int:
    """Run the experiment locally, the client processes on ``devices`` (see
    :func:`client_processes`), the server's Prometheus metrics on ``127.0.0.1:metrics_port``
    (None: off), each process running ``command`` (the ``fedpart`` command's entry) with its
    arguments; returns the exit code (0 when the server and every client succeeded). With
    ``resume``, continue the stopped run in ``out_dir`` (its server resumed, its client processes
    started again on their state directories). Raises ConfigError (or DeviceError, or ImportError
    without prometheus-client), before anything starts, for a config, device, run directory or
    option that cannot be run."""
    from fedpart.common.config.experiment import LocalData, check_experiment
    from fedpart.server.output.metrics import check_metrics_available
    from fedpart.server.output.run_directory import check_new_run_dir
    from fedpart.server.engine.run_state import read_run_state

    if metrics_port is not None:
        check_metrics_available()
    check_experiment(config, clients_data=LocalData(config.data.root), server_data=True)
    placed, notes = client_processes(config, devices)
    if resume:
        read_run_state(out_dir, config.to_dict())  # a run that cannot be resumed is said now
    else:
        check_new_run_dir(out_dir, overwrite)
    for note in notes:
        print(stamp(f"fedpart run: note: {note}"), flush=True)
    with tempfile.TemporaryDirectory(prefix="fedpart-credentials-") as secrets:
        return Launch(config_path, overrides, config, Path(out_dir), Path(secrets), overwrite, placed,
                      metrics_port, ForkServer(command), resume).run()


class Launch:
    """One local run: the server, its clients, and what the launcher prints."""

    def __init__(self, config_path: Path, overrides: list[str], config: RunConfig, out: Path, secrets: Path,
                 overwrite: bool, placed: list[tuple[str, str]], metrics_port: int | None, forks: ForkServer,
                 resume: bool = False) -> None:
        self.config_path = config_path
        self.overrides = overrides
        self.config = config
        self.out = out
        self.secrets = secrets
        self.overwrite = overwrite
        self.placed = placed
        self.metrics_port = metrics_port
        self.resume = resume
        self.progress: RunProgress | None = None
        self.display = Display(lambda: render_run(self.progress), logger="fedpart.launcher")
        self.lines: queue.Queue = queue.Queue()
        self.forks = forks
        self.clients: list[ForkedProcess] = []
        self.client_logs: list[Path] = []

    def run(self) -> int:
        from fedpart.deploy.certs import write_run_credentials

        write_run_credentials(self.secrets, ["127.0.0.1", "localhost"], self.config.clients, len(self.placed))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        secrets = self.secrets
        # a fresh run, or the stopped one resumed with this launcher's fresh credentials
        run = (["--resume", str(self.out), "--new-credentials"] if self.resume else
               [str(self.config_path), "--out", str(self.out), *(["--overwrite"] if self.overwrite else [])])
        server = self.forks.start(
            ["server", *run, "--address", "127.0.0.1:0", "--resume-command", resume_command(self.out),
             *[a for o in self.overrides for a in ("--set", o)],
             "--progress", "json" if self.display.live else "plain", "--yield-to-training",
             *(["--metrics-port", str(self.metrics_port)] if self.metrics_port is not None else []),
             "--tls-cert", str(secrets / "server.pem"), "--tls-key", str(secrets / "server.key"),
             "--credentials", str(secrets / "credentials.yaml")], env)
        threading.Thread(target=_pump, args=(server.stdout, self.lines), daemon=True).start()
        try:
            with self.display:
                address = self._await_address()
                if address is None:
                    stop_processes([server])
                    _error(f"the server did not start (exit code {server.returncode})")
                    return server.returncode if server.returncode > 0 else ExitCode.ERROR
                self._start_clients(address, env)
                return self._follow(server)
        except Stopped as stop:
            _error(f"{stop.reason}, stopping the server and the clients; continue with: {resume_command(self.out)}")
            return stop.code
        finally:
            stop_processes(self.clients + [server])

    def _start_clients(self, address: str, env: dict[str, str]) -> None:
        """One client process per (id range, device), each writing into its log (the server has
        written the run directory by now; a resumed run's logs go on). The processes find each
        other on this host and share its cores (``fedpart.common.process.limits.HostShare``)."""
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for index, (ids, device) in enumerate(self.placed):
            log_path = logs / f"client_{index}.log"
            self.client_logs.append(log_path)
            if not self.resume:
                log_path.write_text("")
            self.clients.append(self.forks.start(
                ["client", "--server", address, "--clients", ids, "--device", device,
                 "--state-dir", str(self.out / "state" / f"process_{index}"), "--ca", str(self.secrets / "ca.pem"),
                 "--token-file", str(self.secrets / f"process_{index}.token")], env, log_path))

    def _forward(self, line: str) -> None:
        """A line of the server: progress (kept for the live view) or a line to print."""
        progress = RunProgress.parse(line)
        if progress is not None:
            self.progress = progress
        else:
            self.display.print(line.rstrip("\n"))

    def _await_address(self) -> str | None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                return None
            self._forward(line)
            match = _LISTENING.search(line)
            if match:
                return match.group(1)
        return None

    def _follow(self, server: ForkedProcess) -> int:
        """Forward server output until it exits; fail fast when a client process dies."""
        while True:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                self._forward(line)
            for process, log in zip(self.clients, self.client_logs):
                code = process.poll()
                # a client the server told that the run ended early exits 5: the server's code says why
                if code not in (None, ExitCode.COMPLETED, ExitCode.ENDED_EARLY):
                    _error(f"client process {process.pid} failed with exit code {code}; its log ({log}):\n"
                           f"{_tail(log)}")
                    return code
        server_code = server.wait()
        codes = []
        for process in self.clients:
            try:
                codes.append(process.wait(timeout=STOP_SECONDS))
            except subprocess.TimeoutExpired:
                codes.append(None)
        failed = [(p.pid, c, log) for p, c, log in zip(self.clients, codes, self.client_logs) if c != 0]
        if server_code != 0:
            _error(f"server exited with code {server_code}")
            return server_code
        for pid, code, log in failed:
            _error(f"client process {pid} ended with {code}; log {log}:\n{_tail(log)}")
        return ExitCode.ERROR if failed else ExitCode.COMPLETED
