"""One lying client under secure aggregation: what each attack does to the quickstart's model.

Each row is a real run of ``configs/quickstart.yaml`` with ``privacy.secure_aggregation`` on:
``fedpart server`` on 127.0.0.1 with TLS and per-process tokens, two ``fedpart client`` processes
hosting clients 1-5 and 6-9, and client 0 in a third process: a ``fedpart client`` in the clean
row, else the hostile process of ``tests/fixtures/hostile_secagg.py`` (raw gRPC stubs of
``proto/fedpart.proto``) in one of its modes:

- ``honest``: follows the protocol with a zero update (the reference of ``alter-share``);
- ``refuse-share``: drops out before sharing (the run without its update: the reference of
  ``garbage-shares``);
- ``garbage-shares``: random sealed shares to every neighbour;
- ``alter-share``: one revealed share altered in the unmask step;
- ``false-update``: a well-formed masked update of random ring elements (outside what
  semi-honest secure aggregation can check), at the default ``privacy.secure_aggregation_bound``
  and at ``--tight-bound`` (with the honest row at that bound beside it);
- ``clipped-false-update``: a false update that keeps inside the clip (random elements of
  +-bound, weighted as an honest one), what a liar could still do if its input were validated,
  at both bounds.

Per row: the server's exit code, the global model's accuracy on the server's test split after the
last round, how many failures the summary lists, and the clients its failure lines name. Runs go
one after another; accuracy and exit codes only (no timings).

    nice -n 19 python benchmarks/secagg_attacks.py      # the table of docs/secure-aggregation.md
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
from dataclasses import dataclass
from pathlib import Path

import yaml

from fedpart.common.process.records import read_summary
from fedpart.deploy.certs import write_run_credentials
from fedpart.deploy.launcher import stop_processes

REPO = Path(__file__).resolve().parents[1]
HOSTILE = REPO / "tests" / "fixtures" / "hostile_secagg.py"
CONFIG = REPO / "configs" / "quickstart.yaml"
HOSTILE_CLIENT = 0  # the lowest id: its shares are among those a rebuilt secret is interpolated from
PROCESSES = (str(HOSTILE_CLIENT), "1-5", "6-9")
LISTENING = re.compile(r"listening on (\S+:\d+)")
NAMED = re.compile(r"\bclients? \[?(\d+(?:, \d+)*)")  # the ids a failure line names: "client 3", "clients [3, 4]"


@dataclass
class Case:
    name: str
    mode: str | None        # the hostile's mode; None: client 0 is a fedpart client
    bound: float | None     # privacy.secure_aggregation_bound (None: the default)


@dataclass
class Row:
    case: Case
    exit_code: int | None = None
    accuracy: float | None = None
    failures: int = 0
    named: tuple[int, ...] = ()
    first_failure: str = ""


def cases(tight: float) -> list[Case]:
    return [Case("clean", None, None), Case("honest", "honest", None), Case("refuse-share", "refuse-share", None),
            Case("garbage-shares", "garbage-shares", None), Case("alter-share", "alter-share", None),
            Case("false-update", "false-update", None), Case("clipped-false-update", "clipped-false-update", None),
            Case(f"honest, bound {tight:g}", "honest", tight),
            Case(f"false-update, bound {tight:g}", "false-update", tight),
            Case(f"clipped-false-update, bound {tight:g}", "clipped-false-update", tight)]


def _credentials(secrets: Path) -> None:
    """A CA, the server's certificate and a token per process, the first hosting the hostile client alone."""
    write_run_credentials(secrets, ["127.0.0.1", "localhost"], clients=10, processes=len(PROCESSES))
    path = secrets / "credentials.yaml"
    entries = yaml.safe_load(path.read_text())
    for entry, ids in zip(entries["processes"], PROCESSES):
        entry["clients"] = ids
    path.write_text(yaml.safe_dump(entries, sort_keys=False))


def _pump(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def measure(case: Case, work: Path, timeout: float, extra: list[str]) -> Row:
    secrets, out = work / f"{case.name}-secrets", work / case.name.replace(" ", "_").replace(",", "")
    _credentials(secrets)
    sets = ["privacy.secure_aggregation=true", *extra]
    if case.bound is not None:
        sets.append(f"privacy.secure_aggregation_bound={case.bound}")
    fedpart = [sys.executable, "-m", "fedpart"]
    server = subprocess.Popen(
        [*fedpart, "server", str(CONFIG), "--address", "127.0.0.1:0", "--out", str(out),
         *[a for s in sets for a in ("--set", s)], "--tls-cert", str(secrets / "server.pem"),
         "--tls-key", str(secrets / "server.key"), "--credentials", str(secrets / "credentials.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(server.stdout, lines), daemon=True).start()
    started = [server]
    log = (work / f"{out.name}.log").open("w")
    try:
        address = None
        while address is None:
            line = lines.get(timeout=timeout)
            if line is None:
                return Row(case, exit_code=server.wait())
            log.write(line)
            match = LISTENING.search(line)
            address = match.group(1) if match else None
        for index, ids in enumerate(PROCESSES):
            credentials = ["--ca", str(secrets / "ca.pem"), "--token-file", str(secrets / f"process_{index}.token")]
            if ids == str(HOSTILE_CLIENT) and case.mode is not None:
                command = [sys.executable, str(HOSTILE), address, ids, case.mode, *credentials]
            else:
                command = [*fedpart, "client", "--server", address, "--clients", ids, "--threads", "1",
                           "--state-dir", str(out / "state" / f"process_{index}"), *credentials]
            started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        while (line := lines.get(timeout=timeout)) is not None:
            log.write(line)
        code = server.wait(timeout=timeout)
    finally:
        stop_processes(started)
        log.close()
    summary = read_summary(out / "summary.json")
    failures = summary.failures or []
    named = sorted({int(c) for line in failures for ids in NAMED.findall(line) for c in re.findall(r"\d+", ids)})
    accuracy = summary.global_accuracy()
    return Row(case, code, accuracy, len(failures), tuple(named), failures[0] if failures else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tight-bound", type=float, default=0.01,
                        help="the lower privacy.secure_aggregation_bound of the last two rows")
    parser.add_argument("--only", nargs="*", help="run only the cases of these names")
    parser.add_argument("--set", action="append", default=[], help="a further config override, e.g. rounds=2")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds any one wait of a run may take")
    parser.add_argument("--keep", type=Path, help="keep the runs' directories and logs here (default: removed)")
    args = parser.parse_args()
    print("| case | exit code | global accuracy | failures | clients named |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="secagg-attacks-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for case in cases(args.tight_bound):
            if args.only and case.name not in args.only:
                continue
            row = measure(case, work, args.timeout, args.set)
            accuracy = f"{100 * row.accuracy:.1f} %" if row.accuracy is not None else "-"
            named = ", ".join(map(str, row.named)) or "-"
            print(f"| {case.name} | {row.exit_code} | {accuracy} | {row.failures} | {named} |", flush=True)
            if row.first_failure:
                print(f"    first failure: {row.first_failure[:300]}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
