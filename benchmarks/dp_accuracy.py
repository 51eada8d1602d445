"""Accuracy under user-level differential privacy (DP-FedAvg) against the epsilon reached.

Each row is a real ``fedpart run`` (one server and two client processes on 127.0.0.1) of FedAvg
or FedBABU on real MNIST with ``privacy.dp`` on (McMahan et al., ICLR 2018): many small iid
clients (DP-FedAvg's noise on the mean shrinks with the clients of a round), Poisson sampling,
each client's update clipped to ``--clip``, and noise ``z * clip`` on the round's sum, for each
noise multiplier ``z`` of ``--noise`` (0: clipping alone, no guarantee). Everything else is the
same between rows: seed, partition, rounds, local SGD. FedBABU's clients upload only the body, so
its noise covers fewer coordinates, and its clients fine-tune the whole model before testing.

Per row, from the run's ``summary.json``: the epsilon reached at delta = 1 / N^1.1 (Google's
dp-accounting, RDP, for Poisson sampling at q = ``--fraction``), the global model's accuracy on the
MNIST test set, the mean accuracy of the clients on their own test splits before (*initial*) and
after one epoch of fine-tuning (*personalized*), and the wall seconds. Runs go one after another.

    nice -n 19 python benchmarks/dp_accuracy.py            # the table of docs/privacy.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from fedpart.common.process.records import read_summary
from fedpart.deploy.launcher import failure, run_bounded

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO.parent / "shared" / "data"


@dataclass
class Row:
    """One run's outcome (``error`` set when it did not complete)."""

    algorithm: str
    noise: float
    seconds: float
    epsilon: float | None = None
    delta: float | None = None
    global_acc: float | None = None
    initial: float | None = None
    personalized: float | None = None
    error: str | None = None


def run_config(args: argparse.Namespace, algorithm: str, noise: float) -> dict:
    """The run of one row: everything but the algorithm and the noise multiplier is shared."""
    return {
        "name": f"dp-{algorithm}-z{noise:g}",
        "seed": args.seed,
        "rounds": args.rounds,
        "clients": args.clients,
        "processes": 2,
        "sampling": {"scheme": "poisson", "fraction": args.fraction},
        "data": {"dataset": "mnist", "root": str(args.data_root), "options": {"normalize": True},
                 "partition": {"scheme": "iid"}},
        "model": {"name": "mlp", "hidden": args.hidden},
        "algorithm": {"name": algorithm},
        "train": {"epochs": args.epochs, "batch_size": 10, "lr": args.lr, "momentum": 0.0, "weighting": "uniform"},
        "evaluate": {"finetune_epochs": [1], "lr": 0.01, "momentum": 0.9, "batch_size": 50},
        "privacy": {"dp": {"enabled": True, "clip_norm": args.clip, "noise_multiplier": noise}},
        "server": {"round_timeout": 600, "join_timeout": 600},
        "checkpoint": {"every": 0, "keep": 1},
    }


def measure(args: argparse.Namespace, work: Path, algorithm: str, noise: float) -> Row:
    config_path = work / f"{algorithm}-z{noise:g}.yaml"
    config_path.write_text(yaml.safe_dump(run_config(args, algorithm, noise)))
    out = work / f"{algorithm}-z{noise:g}"
    log_path = work / f"{algorithm}-z{noise:g}.log"
    command = [sys.executable, "-m", "fedpart", "run", str(config_path), "--out", str(out)]
    code, seconds = run_bounded(command, log_path, args.timeout, cwd=REPO)
    if code != 0:
        return Row(algorithm, noise, seconds, error=failure(code, args.timeout, log_path))
    summary = read_summary(out / "summary.json")
    accuracy = summary.accuracy
    return Row(algorithm, noise, seconds, epsilon=summary.privacy.epsilon, delta=summary.privacy.delta,
               global_acc=summary.global_accuracy(),
               initial=accuracy.initial.mean, personalized=accuracy.personalized["1"].mean)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (epsilon "inf" without noise)."""
    lines = ["| algorithm | noise multiplier | epsilon | global acc % | initial acc % | personalized (1 ep) % | seconds |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.error:
            lines.append(f"| {row.algorithm} | {row.noise:g} | failed: {row.error.splitlines()[0]} | | | | |")
            continue
        epsilon = "inf" if row.epsilon is None else f"{row.epsilon:.3g}"
        lines.append(f"| {row.algorithm} | {row.noise:g} | {epsilon} | {_percent(row.global_acc)} | "
                     f"{_percent(row.initial)} | {_percent(row.personalized)} | {row.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="fedavg,fedbabu")
    parser.add_argument("--noise", default="0,0.5,1,2,4,8", help="noise multipliers, comma-separated")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--fraction", type=float, default=0.1, help="Poisson sampling probability q")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2, help="local epochs")
    parser.add_argument("--clip", type=float, default=0.5, help="privacy.dp.clip_norm")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=32, help="the mlp's hidden width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", type=Path, default=DATA_ROOT, help="holds MNIST/raw/*.gz")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    noises = [float(z) for z in args.noise.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as temporary:
        work = args.out or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        for algorithm in args.algorithms.split(","):
            for noise in noises:
                rows.append(measure(args, work, algorithm, noise))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\nMNIST, mlp (hidden {args.hidden}), {args.clients} iid clients, Poisson q = {args.fraction}, "
          f"{args.rounds} rounds of {args.epochs} local epochs (lr {args.lr:g}), clip {args.clip:g}, delta = 1/N^1.1 = {1 / args.clients ** 1.1:.3g}, seed {args.seed}")
    print(table(rows))
    return 0 if not any(row.error for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
