"""Every algorithm, optimizer and codec on one setting, side by side.

Each row is a real ``fedpart run`` (one server and ``--processes`` client processes on 127.0.0.1)
of ``configs/mnist_cnn2.yaml`` with the same ``--set`` overrides: real MNIST, model ``cnn2``, 20
clients with 2 label shards each, the same seed, rounds, sampling fraction, local SGD and
FedBABU-style fine-tuning protocol. A row is a *variant* (an algorithm with its options scaled to
a short run, possibly with extra objective terms or a server optimizer, see :data:`VARIANTS`)
crossed with an upload *codec* (see :data:`CODECS`); nothing else differs between runs.

What is measured, per row (from the run's ``summary.json`` and ``metrics.jsonl``):

- accuracy on the clients' own test splits, mean +- std over clients (unweighted), of the final
  global model with the client's personal parts (*initial*) and after each fine-tune epoch count
  (*personalized*); the global model's accuracy on the server's test set where the algorithm has
  a complete global model;
- bytes down and up per round (every serialized message of the round, means over rounds; the
  first round also carries the one-time copies of tensors a client process did not hold yet),
  and the tensor bytes uploaded per round for the body and the head;
- the upload compression ratio measured on the wire: decoded tensor bytes over the encoded
  tensor bytes that crossed it (1.00 without a codec);
- client compute seconds per round (the sum over the round's clients of their local training
  time, mean over rounds), trainable parameters per client (sample-weighted over the round's
  clients) in the first and the last round, and the server's round wall seconds (mean).

The runs go one after another (never in parallel, so that timings are comparable); a run that
fails or outlives ``--timeout`` is stopped by PID and reported in its row. ``--report DIR`` also
writes the ``fedpart report`` of the runs (figures and the HTML page; needs the ``report`` extra).
For one config across algorithms alone, ``fedpart compare`` does the same as a product feature;
this benchmark adds the fixed MNIST setting, the compositions and server optimizers, and the
codec axis with the measured compression ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedpart.common.ml.algorithms import ALGORITHMS
from fedpart.common.process.records import ClientStats, read_rounds, read_summary
from fedpart.deploy.launcher import failure, run_bounded

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "mnist_cnn2.yaml"
CLIENTS = 20
SHARDS_PER_CLIENT = 2
FINETUNE_LR = 0.001
FINETUNE_MOMENTUM = 0.9
FINETUNE_BATCH_SIZE = 50

# Algorithm options scaled to a run of a few rounds.
ALGORITHM_OPTIONS: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.01},
    "fedprox_babu": {"mu": 0.01},
    "fedbug": {"gu_ratio": 0.2},
    "layer_expansion_vanilla": {"unfreeze_rounds": [0, 1, 2]},
    "layer_expansion_anti": {"unfreeze_rounds": [0, 1, 2]},
    "fedrep": {"head_epochs": 1, "body_epochs": 1},
    "fedftha": {"tau_sync": 1, "tau_head": 1},
    "perfedavg": {"alpha": 0.05, "beta": 0.05},
}

# Compositions over the seams: objective terms and server optimizers added to an algorithm by
# configuration alone (the FedBug paper pairs FedBug with FedDyn, FedExp and FedDecorr).
COMPOSED: dict[str, dict[str, Any]] = {
    "perfedavg_hf": {"algorithm.name": "perfedavg", "algorithm.alpha": 0.05, "algorithm.beta": 0.05,
                     "algorithm.hessian": True},
    "feddyn": {"algorithm.name": "fedavg", "algorithm.objective": {"feddyn": {"alpha": 0.01}}},
    "feddecorr": {"algorithm.name": "fedavg", "algorithm.objective": {"feddecorr": {"beta": 0.1}}},
    "fedavgm": {"algorithm.name": "fedavg", "server_optimizer.name": "fedavgm"},
    "fedadam": {"algorithm.name": "fedavg", "server_optimizer.name": "fedadam"},
    "fedexp": {"algorithm.name": "fedavg", "server_optimizer.name": "fedexp"},
    "fedbug+feddyn": {"algorithm.name": "fedbug", "algorithm.gu_ratio": 0.2,
                      "algorithm.objective": {"feddyn": {"alpha": 0.01}}},
    "fedbug+fedexp": {"algorithm.name": "fedbug", "algorithm.gu_ratio": 0.2, "server_optimizer.name": "fedexp"},
    "fedbug+feddecorr": {"algorithm.name": "fedbug", "algorithm.gu_ratio": 0.2,
                         "algorithm.objective": {"feddecorr": {"beta": 0.1}}},
}

# Row name -> the settings that make it: every declared algorithm, then the compositions.
VARIANTS: dict[str, dict[str, Any]] = {
    **{name: {"algorithm.name": name, **{f"algorithm.{key}": value
                                         for key, value in ALGORITHM_OPTIONS.get(name, {}).items()}}
       for name in ALGORITHMS},
    **COMPOSED,
}

# Upload codec -> its settings (issue 10's axis: none, int8, top-k 1 % with error feedback).
CODECS: dict[str, dict[str, Any]] = {
    "none": {},
    "int8": {"compression.up.codec": "qsgd8"},
    "topk1%": {"compression.up.codec": "topk", "compression.up.fraction": 0.01,
               "compression.up.error_feedback": True},
}


def default_data_root() -> Path:
    """``<checkout>/../shared/data``: the real MNIST copy beside the repository."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def _setting(key: str, value: Any) -> str:
    """One ``key=value`` override; JSON is valid YAML, which is how fedpart parses the value."""
    return f"{key}={json.dumps(value)}"


def common_overrides(args: argparse.Namespace) -> list[str]:
    """The settings every algorithm's run shares."""
    return [
        _setting("seed", args.seed),
        _setting("rounds", args.rounds),
        _setting("clients", CLIENTS),
        _setting("processes", args.processes),
        _setting("sampling.fraction", args.fraction),
        _setting("data.dataset", "mnist"),
        _setting("data.root", str(args.data_root.resolve())),
        _setting("data.partition.scheme", "shards"),
        _setting("data.partition.shards_per_client", SHARDS_PER_CLIENT),
        _setting("model.name", "cnn2"),
        _setting("train.epochs", args.epochs),
        _setting("train.batch_size", args.batch_size),
        _setting("train.lr", args.lr),
        _setting("train.momentum", args.momentum),
        _setting("evaluate.finetune_epochs", args.finetune_epochs),
        _setting("evaluate.part", "full"),
        _setting("evaluate.lr", FINETUNE_LR),
        _setting("evaluate.momentum", FINETUNE_MOMENTUM),
        _setting("evaluate.batch_size", FINETUNE_BATCH_SIZE),
    ]


def row_overrides(variant: str, codec: str) -> list[str]:
    """The run name and the settings of one variant with one upload codec."""
    settings = {"name": f"compare_{variant}_{codec}".replace("+", "_").replace("%", "pct"),
                **VARIANTS[variant], **CODECS[codec]}
    return [_setting(key, value) for key, value in settings.items()]


# ------------------------------------------------------------------------------------ running


@dataclass
class Result:
    """One row's run: where it is, how it ended, and the numbers read from it."""

    variant: str
    codec: str
    out: str
    wall_seconds: float
    error: str | None = None
    initial: ClientStats = field(default_factory=ClientStats)
    personalized: dict[str, ClientStats] = field(default_factory=dict)
    global_accuracy: float | None = None
    bytes_down_per_round: float | None = None
    bytes_up_per_round: float | None = None
    body_up_per_round: float | None = None
    head_up_per_round: float | None = None
    client_compute_seconds_per_round: float | None = None
    trainable_parameters_first: float | None = None
    trainable_parameters_last: float | None = None
    round_seconds: float | None = None
    up_compression_ratio: float | None = None
    failures: list[str] = field(default_factory=list)


def run_row(variant: str, codec: str, overrides: list[str], out: Path, timeout: float) -> Result:
    """``fedpart run`` for one variant and codec (bounded wait, stopped by PID), then its numbers."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.name}.log"  # beside the run directory: fedpart run wants a new one
    command = [sys.executable, "-m", "fedpart", "run", str(CONFIG), "--out", str(out)]
    command += [a for o in overrides + row_overrides(variant, codec) for a in ("--set", o)]
    code, wall = run_bounded(command, log_path, timeout, cwd=REPO)
    if code != 0:
        return Result(variant, codec, str(out), wall, error=failure(code, timeout, log_path))
    try:
        return read_run(variant, codec, out, wall)
    except (OSError, KeyError, ValueError) as error:
        return Result(variant, codec, str(out), wall, error=f"unreadable run directory: {error!r}")


def read_run(variant: str, codec: str, out: Path, wall: float) -> Result:
    """The numbers of a finished run from ``summary.json`` and ``metrics.jsonl``."""
    summary = read_summary(out / "summary.json")
    records = read_rounds(out / "metrics.jsonl")
    if not records:
        raise ValueError("metrics.jsonl has no rounds")
    accuracy = summary.accuracy

    def mean(values: list[float]) -> float:
        return statistics.fmean(values)

    def part_up(part: str) -> float:
        return mean([r.bytes_by_part[part].up if part in r.bytes_by_part else 0 for r in records])

    trainable = [r.trainable_parameters for r in records]
    return Result(
        variant=variant,
        codec=codec,
        out=str(out),
        wall_seconds=wall,
        initial=accuracy.initial,
        personalized=accuracy.personalized,
        global_accuracy=accuracy.global_value(),
        bytes_down_per_round=mean([r.bytes_down for r in records]),
        bytes_up_per_round=mean([r.bytes_up for r in records]),
        body_up_per_round=part_up("body"),
        head_up_per_round=part_up("head"),
        client_compute_seconds_per_round=mean([r.client_compute_seconds for r in records]),
        trainable_parameters_first=trainable[0],
        trainable_parameters_last=trainable[-1],
        round_seconds=mean([r.seconds for r in records]),
        up_compression_ratio=(summary.bytes.compression_ratio or {}).get("up"),
        failures=summary.failures,
    )


# ------------------------------------------------------------------------------------- report


def _percent(stats: ClientStats) -> str:
    mean, std = stats.mean, stats.std
    return "-" if mean is None else f"{100 * mean:.2f} ± {100 * (std or 0.0):.2f}"


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.3f}"


def table(results: list[Result], finetune_epochs: list[int]) -> str:
    """One markdown table, a row per variant and codec."""
    epochs = sorted(set(finetune_epochs))
    header = (["variant", "codec up", "initial acc %"] + [f"personalized {e} ep %" for e in epochs]
              + ["global acc %", "down MB/round", "up MB/round", "up ratio", "up body/head MB/round",
                 "client compute s/round", "trainable params/client first → last", "round s"])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for r in results:
        if r.error is not None:
            cells = [r.variant, r.codec, f"FAILED ({r.error.splitlines()[0]})"] + [""] * (len(header) - 3)
        else:
            name = f"{r.variant} ({len(r.failures)} failures)" if r.failures else r.variant
            cells = ([name, r.codec, _percent(r.initial)]
                     + [_percent(r.personalized.get(str(e), ClientStats())) for e in epochs]
                     + [_number(None if r.global_accuracy is None else 100 * r.global_accuracy, ".2f"),
                        _megabytes(r.bytes_down_per_round), _megabytes(r.bytes_up_per_round),
                        _number(r.up_compression_ratio, ".2f"),
                        f"{_megabytes(r.body_up_per_round)} / {_megabytes(r.head_up_per_round)}",
                        _number(r.client_compute_seconds_per_round, ".2f"),
                        (f"{_number(r.trainable_parameters_first, ',.0f')} → "
                         f"{_number(r.trainable_parameters_last, ',.0f')}"),
                        _number(r.round_seconds, ".2f")])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _names(text: str, known: dict[str, Any], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    """A comma-separated subset of ``known`` (error naming the unknown ones)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of the variants (default: all)")
    parser.add_argument("--codecs", default=",".join(CODECS),
                        help="comma-separated subset of the upload codecs (default: all)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--fraction", type=float, default=0.25, help="sampling.fraction")
    parser.add_argument("--epochs", type=int, default=1, help="train.epochs")
    parser.add_argument("--batch-size", type=int, default=50, help="train.batch_size")
    parser.add_argument("--lr", type=float, default=0.05, help="train.lr")
    parser.add_argument("--momentum", type=float, default=0.5, help="train.momentum")
    parser.add_argument("--finetune-epochs", default="1", help="evaluate.finetune_epochs, comma-separated")
    parser.add_argument("--processes", type=int, default=2, help="client processes per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", type=Path, default=default_data_root(), help="holds MNIST/raw/*.gz")
    parser.add_argument("--out-root", type=Path, help="run directories go here (default: a new temp dir)")
    parser.add_argument("--json", type=Path, help="write the table and the raw numbers to this file")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--report", type=Path, help="also write the fedpart report of the runs into this new folder")
    args = parser.parse_args(argv)
    args.variants = _names(args.variants, VARIANTS, "--variants", parser)
    args.codecs = _names(args.codecs, CODECS, "--codecs", parser)
    args.finetune_epochs = [int(e) for e in args.finetune_epochs.split(",") if e.strip()]
    if args.report:  # refused now rather than after the runs
        from fedpart.report.build import require_plotting
        from fedpart.report.runs import ReportError

        try:
            require_plotting()
        except ReportError as error:
            parser.error(f"--report: {error}")
        if args.report.exists() and (not args.report.is_dir() or any(args.report.iterdir())):
            parser.error(f"--report {args.report}: exists and is not an empty folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_root = args.out_root or Path(tempfile.mkdtemp(prefix="fedpart-compare-"))
    overrides = common_overrides(args)
    print(f"config {CONFIG.relative_to(REPO)}; run directories under {out_root}")
    print("settings of every run: " + " ".join(overrides))
    for name in args.variants:
        print(f"  {name}: " + " ".join(row_overrides(name, "none")[1:]))
    for codec in args.codecs:
        print(f"  codec {codec}: " + (" ".join(_setting(k, v) for k, v in CODECS[codec].items()) or "(raw)"))
    print(flush=True)
    results: list[Result] = []
    started = time.perf_counter()
    for variant in args.variants:
        for codec in args.codecs:
            out = out_root / f"{variant}_{codec}".replace("+", "_").replace("%", "pct")
            result = run_row(variant, codec, overrides, out, args.timeout)
            status = "FAILED: " + result.error if result.error else "ok"
            print(f"{variant} / {codec}: {result.wall_seconds:.1f} s, {status}", flush=True)
            results.append(result)
    total = time.perf_counter() - started
    rendered = table(results, args.finetune_epochs)
    print()
    print(rendered)
    print()
    print(f"total wall time {total:.1f} s for {len(results)} runs")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "settings": overrides,
            "variants": {n: VARIANTS[n] for n in args.variants},
            "codecs": {c: CODECS[c] for c in args.codecs},
            "total_wall_seconds": total,
            "table": rendered,
            "results": [asdict(r) for r in results],
        }, indent=1))
    if args.report:
        from fedpart.report.build import write_report

        reported = [r for r in results if (Path(r.out) / "config.yaml").is_file()]
        if reported:
            report = write_report([r.out for r in reported], args.report,
                                  labels=[f"{r.variant}/{r.codec}" for r in reported])
            print(f"report: {report.page}")
        else:
            print("report: no run left a run directory")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
