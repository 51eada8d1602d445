"""What secure aggregation costs: bytes and round time with and without it.

Each row is a real ``fedpart run`` (one server and two client processes on 127.0.0.1, TLS on) of
FedAvg and of FedBABU on the embedded digits with an mlp, every client in every round, for each
number of clients of ``--clients``: without secure aggregation, with it over the full graph
(SecAgg, Bonawitz et al., CCS 2017), and with ``privacy.secure_aggregation_neighbours`` set
(SecAgg+, Bell et al., CCS 2020) where the round has more clients than that. Everything else is
the same between the rows of one size: seed, partition, rounds, local SGD.

Per row, from the run's ``metrics.jsonl`` (rounds after the first, which also pays the start-up):
the mean round seconds on the server, the logical bytes a round moves (each client its own device:
up and down), and the part of them that is the protocol's own traffic (the ledger part ``secagg``:
keys, commitments, sealed shares, disputes, the masking and unmasking lists, revealed shares, the
headers of the four extra tasks), per client and in all. The masked update itself is as large as
the plain float32 update and is counted under body/head. Runs go one after another.

    nice -n 19 python benchmarks/secure_aggregation.py      # the table of docs/secure-aggregation.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from fedpart.common.process.records import RoundRecord, read_rounds
from fedpart.deploy.launcher import failure, run_bounded

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    """One run's outcome (``error`` set when it did not complete)."""

    algorithm: str
    clients: int
    variant: str
    seconds: float = 0.0           # mean round seconds after the first round
    logical_up: float = 0.0        # logical bytes per round
    logical_down: float = 0.0
    secagg_up: float = 0.0         # of which the protocol's own, per round
    secagg_down: float = 0.0
    error: str | None = None


def run_config(args: argparse.Namespace, algorithm: str, clients: int, neighbours: int | None,
               secure: bool) -> dict:
    return {
        "name": f"secagg-{algorithm}-{clients}",
        "seed": args.seed,
        "rounds": args.rounds,
        "clients": clients,
        "processes": 2,
        "data": {"dataset": "digits", "partition": {"scheme": "iid"}},
        "model": {"name": "mlp", "hidden": args.hidden},
        "algorithm": {"name": algorithm},
        "train": {"epochs": 1, "batch_size": 10, "lr": 0.05, "momentum": 0.5},
        "evaluate": {"finetune_epochs": [1], "batch_size": 50},
        "server": {"round_timeout": args.timeout, "join_timeout": args.timeout},
        "privacy": {"secure_aggregation": secure, "secure_aggregation_neighbours": neighbours},
    }


def measure(args: argparse.Namespace, work: Path, algorithm: str, clients: int, variant: str) -> Row:
    neighbours = args.neighbours if variant == "secagg+" else None
    name = f"{algorithm}-{clients}-{variant}"
    config_path = work / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(run_config(args, algorithm, clients, neighbours, variant != "plain")))
    out, log_path = work / name, work / f"{name}.log"
    command = [sys.executable, "-m", "fedpart", "run", str(config_path), "--out", str(out)]
    code, _ = run_bounded(command, log_path, args.timeout, cwd=REPO)
    if code != 0:
        return Row(algorithm, clients, variant, error=failure(code, args.timeout, log_path))
    rounds = read_rounds(out / "metrics.jsonl")[1:]

    def mean(values) -> float:
        return statistics.fmean(values) if rounds else 0.0

    def secagg(record: RoundRecord, direction: str) -> int:
        counts = record.logical.by_part.get("secagg")
        return counts.bytes_in(direction) if counts is not None else 0

    return Row(algorithm, clients, variant, seconds=mean(r.seconds for r in rounds),
               logical_up=mean(r.logical.up for r in rounds), logical_down=mean(r.logical.down for r in rounds),
               secagg_up=mean(secagg(r, "up") for r in rounds), secagg_down=mean(secagg(r, "down") for r in rounds))


def table(rows: list[Row]) -> str:
    lines = ["| algorithm | clients a round | aggregation | round s | logical up/down per round (kB) | "
             "secagg up/down per round (kB) | secagg per client up/down (B) | secagg share of all bytes |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.error:
            lines.append(f"| {row.algorithm} | {row.clients} | {row.variant} | failed: {row.error.splitlines()[0]} "
                         "| | | | |")
            continue
        total = row.logical_up + row.logical_down
        share = (row.secagg_up + row.secagg_down) / total if total else 0.0
        lines.append(f"| {row.algorithm} | {row.clients} | {row.variant} | {row.seconds:.2f} | "
                     f"{row.logical_up / 1e3:,.0f} / {row.logical_down / 1e3:,.0f} | "
                     f"{row.secagg_up / 1e3:,.1f} / {row.secagg_down / 1e3:,.1f} | "
                     f"{row.secagg_up / row.clients:,.0f} / {row.secagg_down / row.clients:,.0f} | {100 * share:.1f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="fedavg,fedbabu")
    parser.add_argument("--clients", default="10,50,100", help="clients (all in every round), comma-separated")
    parser.add_argument("--neighbours", type=int, default=8, help="privacy.secure_aggregation_neighbours of SecAgg+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64, help="the mlp's hidden width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as temporary:
        work = args.out or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        for algorithm in args.algorithms.split(","):
            for clients in (int(n) for n in args.clients.split(",")):
                variants = ["plain", "secagg"] + (["secagg+"] if clients > args.neighbours + 1 else [])
                for variant in variants:
                    rows.append(measure(args, work, algorithm, clients, variant))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\ndigits, mlp (hidden {args.hidden}), iid, every client every round, {args.rounds} rounds (rounds 2-"
          f"{args.rounds} averaged), 2 client processes, TLS, seed {args.seed}; SecAgg+ with "
          f"{args.neighbours} neighbours")
    print(table(rows))
    return 0 if not any(row.error for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
