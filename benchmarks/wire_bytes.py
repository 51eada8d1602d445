"""Measured wire bytes beside the ledger's: what the TCP connections of a run really carry.

The ledger (``summary.json`` ``bytes``) counts serialized protobuf messages. On the wire each
message also travels inside gRPC's 5-byte message prefix, HTTP/2 frames (HEADERS with the method,
the token and the status, DATA, WINDOW_UPDATE, SETTINGS, keepalive PINGs) and, with TLS, TLS
records and the handshakes. This runs the quickstart (``fedpart server`` and ``--processes``
``fedpart client`` processes on 127.0.0.1, TLS with per-process tokens unless ``--plaintext``)
with every client connection through ``lab.relay``, which counts the TCP payload it
forwards per direction, and prints per algorithm and direction: the relay's bytes, the ledger's
physical bytes (what crossed the connections, as protobuf), their ratio, and the ledger's logical
bytes (each client its own device) for comparison::

    python benchmarks/wire_bytes.py --algorithms fedavg,fedbabu --rounds 3

The relay counts everything the processes send after they connect, the last polls and the
leave calls after the server wrote ``summary.json`` included; the ledger counts every message up
to its summary. So the ratio is an upper bound of the framing overhead, by a few hundred bytes.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedpart.common.wire.client_ids import split_clients
from fedpart.common.process.records import DIRECTIONS, read_summary
from fedpart.deploy.certs import write_run_credentials
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the lab (lab/relay.py), beside the package
from lab.relay import RelayThread  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "fedpart"]
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class Measurement:
    """One run's bytes per direction: through the relay, and as the server's ledger counted them."""

    algorithm: str
    tls: bool
    wire: dict[str, int]
    physical: dict[str, int]
    logical: dict[str, int]
    connections: int

    @property
    def transport(self) -> str:
        return "TLS" if self.tls else "plaintext"

    def ratio(self, direction: str) -> float:
        """Wire bytes per ledger physical byte."""
        return self.wire[direction] / self.physical[direction]


def quickstart_config(algorithm: str, rounds: int, clients: int, processes: int) -> dict[str, Any]:
    """``configs/quickstart.yaml`` with this algorithm, rounds, clients and processes."""
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config.update(rounds=rounds, clients=clients, processes=processes, algorithm={"name": algorithm})
    config["server"] = {"round_timeout": 600, "join_timeout": 300, "heartbeat_timeout": 120}
    return config


class _OutputReader:
    """A process's output lines, read on a thread, so a wait for one has a deadline."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"no line matching {pattern.pattern!r} within {timeout:.0f} s:\n"
                                   + "".join(self.lines[-20:])) from None
            if line is None:
                raise RuntimeError(f"the process ended before printing {pattern.pattern!r}:\n" + "".join(self.lines[-20:]))
            self.lines.append(line)
            match = pattern.search(line)
            if match:
                return match

    def rest(self, timeout: float) -> str:
        """Every line until the output ends (``timeout`` at most for each)."""
        while (line := self._queue.get(timeout=timeout)) is not None:
            self.lines.append(line)
        return "".join(self.lines)


def measure(config: dict[str, Any], work: Path, tls: bool = True, timeout: float = 1200.0) -> Measurement:
    """Run ``config`` (its ``clients`` and ``processes``) with the clients behind a counting relay."""
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    clients, processes = config["clients"], config["processes"]
    out = work / "run"
    secrets = work / "secrets"
    server_args = ["server", str(config_path), "--address", "127.0.0.1:0", "--out", str(out)]
    if tls:
        write_run_credentials(secrets, ["127.0.0.1"], clients=clients, processes=processes)
        server_args += ["--tls-cert", str(secrets / "server.pem"), "--tls-key", str(secrets / "server.key"),
                        "--credentials", str(secrets / "credentials.yaml")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started: list[subprocess.Popen] = []
    relays: list[RelayThread] = []
    try:
        server = subprocess.Popen(CLI + server_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        started.append(server)
        server_output = _OutputReader(server)
        address = server_output.wait_for(_LISTENING, timeout)
        relays.append(RelayThread((address.group(1), int(address.group(2)))))
        host, port = relays[-1].start()
        client_outputs = []
        for index, ids in enumerate(split_clients(clients, processes)):
            client_args = ["client", "--server", f"{host}:{port}", "--clients", ids, "--threads", "1",
                           "--state-dir", str(out / "state" / f"process_{index}")]
            if tls:
                client_args += ["--ca", str(secrets / "ca.pem"), "--token-file", str(secrets / f"process_{index}.token")]
            client = subprocess.Popen(CLI + client_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env)
            started.append(client)
            client_outputs.append(_OutputReader(client))
        output = server_output.rest(timeout)
        if server.wait(timeout) != 0:
            raise RuntimeError(f"the server failed:\n{output[-3000:]}")
        for client, client_output in zip(started[1:], client_outputs):
            log = client_output.rest(timeout)
            if client.wait(timeout) != 0:
                raise RuntimeError(f"a client process failed:\n{log[-3000:]}")
        counts = [relay.counts() for relay in relays]
    finally:
        for relay in relays:
            relay.stop()
        for process in started:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
    summary = read_summary(out / "summary.json")
    return Measurement(config["algorithm"]["name"], tls, {d: sum(getattr(c, d) for c in counts) for d in DIRECTIONS},
                       {d: summary.bytes.bytes_in(d) for d in DIRECTIONS},
                       {d: summary.bytes.logical.bytes_in(d) for d in DIRECTIONS}, sum(c.relayed for c in counts))


def format_table(measurements: list[Measurement]) -> str:
    header = (f"{'algorithm':<10}{'transport':<22}{'direction':<10}{'wire B (TCP payload)':>22}"
              f"{'ledger physical B':>19}{'wire / ledger':>15}{'ledger logical B':>18}")
    lines = [header]
    for m in measurements:
        for direction in DIRECTIONS:
            lines.append(f"{m.algorithm:<10}{m.transport:<22}{direction:<10}"
                         f"{m.wire[direction]:>22,}{m.physical[direction]:>19,}{m.ratio(direction):>15.4f}"
                         f"{m.logical[direction]:>18,}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default="fedavg,fedbabu", help="comma-separated (default fedavg,fedbabu)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--plaintext", action="store_true", help="no TLS (HTTP/2 framing alone)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds each wait may take")
    args = parser.parse_args(argv)
    measurements = []
    with tempfile.TemporaryDirectory(prefix="fedpart-wire-") as work:
        for algorithm in args.algorithms.split(","):
            config = quickstart_config(algorithm, args.rounds, args.clients, args.processes)
            measurements.append(measure(config, Path(work) / algorithm, tls=not args.plaintext, timeout=args.timeout))
            print(f"{algorithm}: {measurements[-1].connections} connections relayed", flush=True)
    print(f"quickstart (digits, mlp), {args.clients} clients in {args.processes} processes, {args.rounds} rounds, "
          "final evaluation included")
    print(format_table(measurements))
    return 0


if __name__ == "__main__":
    sys.exit(main())
