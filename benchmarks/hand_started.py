"""Client processes started by hand on one host against ``fedpart run``, measured in one run.

Workload: the quickstart (digits, mlp, 10 clients, FedBABU) with ``train.epochs`` 4 and
``--rounds`` rounds (default 15), its clients in ``--processes`` client processes (default 2).

- **fedpart run**: ``fedpart run`` with ``processes`` set to P.
- **by hand**: what the README's "Across machines" shows, on one host: ``fedpart certs``, then
  ``fedpart server`` with TLS and credentials, then P ``fedpart client`` processes started one
  after another with their token and nothing else (no thread flag): the processes find each
  other and share the host's cores by themselves (``fedpart.common.process.limits.HostShare``).
- **by hand, every core each** (``--every-core``): the same with ``--threads`` set to all the
  cores of the host in every client process, which is what each took before they found each other.

Printed per setting: the median and the slowest of the rounds' ``seconds`` (``metrics.jsonl``,
the first round left out) and the median's ratio to ``fedpart run``'s. Each setting runs
``--repeat`` times (default 1), taking turns, and the medians are over all their rounds. Every
process is stopped by PID when a setting ends, however it ends. ::

    python benchmarks/hand_started.py --processes 2 --repeat 2
    python benchmarks/hand_started.py --processes 4 --every-core
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from fedpart.common.process.records import read_rounds

CLI = [sys.executable, "-m", "fedpart"]
REPO = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"listening on (\S+:\d+)")


def quickstart(rounds: int, processes: int) -> dict:
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["rounds"], config["processes"] = rounds, processes
    config["train"]["epochs"] = 4
    config["evaluate"]["finetune_epochs"] = [1]
    return config


def _rounds(out: Path) -> list[float]:
    return [record.seconds for record in read_rounds(out / "metrics.jsonl")][1:]


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def launched(config_path: Path, out: Path, timeout: float) -> list[float]:
    """``fedpart run``'s rounds."""
    process = subprocess.Popen(CLI + ["run", str(config_path), "--out", str(out)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        if process.wait(timeout=timeout) != 0:
            raise RuntimeError(f"fedpart run failed with exit code {process.returncode}")
    finally:
        _stop([process])
    return _rounds(out)


def by_hand(config: dict, config_path: Path, work: Path, threads: int | None, timeout: float) -> list[float]:
    """The rounds of a server and client processes started one after another, as the README says."""
    secrets, out = work / "secrets", work / "run"
    subprocess.run(CLI + ["certs", "--out", str(secrets), "--server-names", "127.0.0.1",
                          "--clients", str(config["clients"]), "--processes", str(config["processes"])],
                   check=True, stdout=subprocess.DEVNULL)
    started: list[subprocess.Popen] = []
    try:
        server = subprocess.Popen(CLI + ["server", str(config_path), "--address", "127.0.0.1:0", "--out", str(out),
                                         "--tls-cert", str(secrets / "server.pem"), "--tls-key",
                                         str(secrets / "server.key"), "--credentials",
                                         str(secrets / "credentials.yaml")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(server)
        address = None
        deadline = time.monotonic() + timeout
        while address is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("the server ended before it listened")
            match = _LISTENING.search(line)
            address = match.group(1) if match else None
        credentials = yaml.safe_load((secrets / "credentials.yaml").read_text())["processes"]
        for index, entry in enumerate(credentials):
            started.append(subprocess.Popen(
                CLI + ["client", "--server", address, "--clients", str(entry["clients"]), "--ca",
                       str(secrets / "ca.pem"), "--token-file", str(secrets / f"process_{index}.token"),
                       "--state-dir", str(work / f"state_{index}"),
                       *(["--threads", str(threads)] if threads is not None else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for line in server.stdout:  # drain it, or the server blocks on a full pipe
            pass
        if server.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
            raise RuntimeError(f"the server failed with exit code {server.returncode}")
    finally:
        _stop(started)
    return _rounds(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="client processes (default 2)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of each run (default 15)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each setting, taking turns (default 1)")
    parser.add_argument("--every-core", action="store_true",
                        help="also the hand-started processes with --threads set to every core of the host")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take (default 1800)")
    args = parser.parse_args(argv)
    config = quickstart(args.rounds, args.processes)
    cores = len(os.sched_getaffinity(0))
    settings = {"fedpart run": None, "by hand": None}
    if args.every_core:
        settings["by hand, every core each"] = cores
    rounds: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="fedpart-hand-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        for repeat in range(args.repeat):
            for name, threads in settings.items():
                work = Path(tmp) / f"{repeat}-{len(rounds[name])}-{name.replace(' ', '_').replace(',', '')}"
                work.mkdir()
                if name == "fedpart run":
                    rounds[name] += launched(config_path, work / "run", args.timeout)
                else:
                    rounds[name] += by_hand(config, config_path, work, threads, args.timeout)
                print(f"{name}: run {repeat + 1} done", flush=True)
    floor = statistics.median(rounds["fedpart run"])
    print(f"quickstart, epochs 4, {args.rounds} rounds, {args.processes} client processes on {cores} cores, "
          f"{args.repeat} run(s) each")
    print(f"{'setting':<28}{'median round s':>15}{'slowest s':>11}{'/ fedpart run':>15}")
    for name, seconds in rounds.items():
        median = statistics.median(seconds)
        print(f"{name:<28}{median:>15.3f}{max(seconds):>11.2f}{median / floor:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
