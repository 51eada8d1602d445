"""``fedpart run``: one server and ``processes`` client processes on 127.0.0.1 (or one client
process per device of ``--devices``).

The launcher makes throw-away credentials for the run (``fedpart certs`` into a private temporary
directory, removed afterwards), so the local run uses TLS and per-process tokens like a deployed
one. The server listens on a free port and announces it on its first output line; the launcher
reads that line (bounded wait), starts the clients with an even share of the client ids and of
the CPU cores, each on its device, forwards the server's output, and stops every process it
started by PID. Any failed process makes the whole run fail.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedpart.client.placement import AUTO, resolve_devices
from fedpart.common.config import RunConfig

STARTUP_SECONDS = 120.0
STOP_SECONDS = 30.0
_LISTENING = re.compile(r"listening on (\S+:\d+)")


def split_clients(num_clients: int, processes: int) -> list[str]:
    """Contiguous, even client-id ranges, one per process (``0-4``, ``5-9``)."""
    processes = max(1, min(processes, num_clients))
    bounds = [round(i * num_clients / processes) for i in range(processes + 1)]
    return [f"{a}-{b - 1}" for a, b in zip(bounds, bounds[1:]) if b > a]


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


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedpart.deploy.cli", *args]


def _pump(stream, sink: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        sink.put(line)
    sink.put(None)


def stop_processes(processes: list[subprocess.Popen], grace_seconds: float = 10.0) -> None:
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


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_local(config_path: Path, overrides: list[str], config: RunConfig, out_dir: str,
              devices: str | None = None) -> int:
    """Run the experiment locally (client processes on ``devices``, see :func:`client_processes`);
    returns 0 when server and every client succeeded."""
    placed, notes = client_processes(config, devices)
    for note in notes:
        print(f"fedpart run: note: {note}", flush=True)
    signal.signal(signal.SIGTERM, _terminated)
    out = Path(out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedpart-credentials-") as secrets:
        return _launch(config_path, overrides, config, out, Path(secrets), placed)


def _launch(config_path: Path, overrides: list[str], config: RunConfig, out: Path, secrets: Path,
            placed: list[tuple[str, str]]) -> int:
    from fedpart.deploy.certs import write_run_credentials

    logs = out / "logs"
    write_run_credentials(secrets, ["127.0.0.1", "localhost"], config.clients, len(placed))
    sets = [a for o in overrides for a in ("--set", o)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = subprocess.Popen(_cli("server", str(config_path), "--address", "127.0.0.1:0", "--out", str(out), *sets,
                                   "--tls-cert", str(secrets / "server.pem"), "--tls-key", str(secrets / "server.key"),
                                   "--credentials", str(secrets / "credentials.yaml")),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(server.stdout, lines), daemon=True).start()
    clients: list[subprocess.Popen] = []
    client_logs: list[Path] = []
    try:
        address = _await_address(lines)
        if address is None:
            print("fedpart run: the server did not start", file=sys.stderr)
            return 1
        threads = max(1, (os.cpu_count() or 1) // len(placed))
        for index, (ids, device) in enumerate(placed):
            log_path = logs / f"client_{index}.log"
            client_logs.append(log_path)
            with log_path.open("w") as log:
                clients.append(subprocess.Popen(
                    _cli("client", "--server", address, "--clients", ids, "--device", device, "--threads", str(threads),
                         "--state-dir", str(out / "state" / f"process_{index}"), "--ca", str(secrets / "ca.pem"),
                         "--token-file", str(secrets / f"process_{index}.token")),
                    stdout=log, stderr=subprocess.STDOUT, env=env))
        return _follow(server, lines, clients, client_logs)
    except KeyboardInterrupt:
        print("fedpart run: interrupted, stopping processes", file=sys.stderr)
        return 130
    finally:
        stop_processes(clients + [server])


def _terminated(signum: int, frame) -> None:
    """SIGTERM: unwind so that the started processes are stopped by PID."""
    raise SystemExit(128 + signum)


def _await_address(lines: queue.Queue) -> str | None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            return None
        print(line, end="", flush=True)
        match = _LISTENING.search(line)
        if match:
            return match.group(1)
    return None


def _follow(server: subprocess.Popen, lines: queue.Queue, clients: list[subprocess.Popen],
            client_logs: list[Path]) -> int:
    """Forward server output until it exits; fail fast when a client process dies."""
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line:
            print(line, end="", flush=True)
        for process, log in zip(clients, client_logs):
            code = process.poll()
            if code not in (None, 0):
                print(f"fedpart run: client process {process.pid} failed with exit code {code}; its log "
                      f"({log}):\n{_tail(log)}", file=sys.stderr, flush=True)
                return 1
    server_code = server.wait()
    codes = []
    for process in clients:
        try:
            codes.append(process.wait(timeout=STOP_SECONDS))
        except subprocess.TimeoutExpired:
            codes.append(None)
    failed = [(p.pid, c, log) for p, c, log in zip(clients, codes, client_logs) if c != 0]
    for pid, code, log in failed:
        print(f"fedpart run: client process {pid} ended with {code}; log {log}:\n{_tail(log)}", file=sys.stderr)
    if server_code != 0:
        print(f"fedpart run: server exited with code {server_code}", file=sys.stderr)
        return server_code
    return 1 if failed else 0
