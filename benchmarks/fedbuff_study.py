"""FedBuff against synchronous rounds, for partial-parameter algorithms, under reproducible device
heterogeneity (issue 53): ``fedpart run`` of FedAvg, FedBABU and FedRep with the synchronous and the
buffered engine, with every device alike and with heavy-tailed speeds and intermittent devices, all
on the virtual clock (``heterogeneity.clock: virtual``), so that each run is deterministic for its
seed and its time is the devices' simulated time, not this machine's.

For each algorithm and device setting the synchronous run trains ``rounds`` rounds; its final
accuracy is the target and its virtual time T. The buffered run trains as many server versions as
fit in T (at most three per synchronous round); for FedAvg the time to target is read from the
global model's accuracy every ``evaluate.global_every`` versions. FedBABU's and FedRep's accuracy
is personalized (after fine-tuning, every client), which exists only at a run's end: their buffered
engine also trains a run of as many versions as fit in T / 2 (the whole buffered run, where it
fits), and reaches the target at least twice as fast when that run's personalized accuracy is at
least the synchronous run's. How many versions
fit in a time comes from a dry run of the engines' own schedule (:class:`~fedpart.server.engine.buffered.Schedule`,
:class:`~fedpart.server.engine.virtual_clock.VirtualClock`): a schedule does not depend on what the
clients learn, and each run's recorded clock is checked against it.

Printed (and written with ``--markdown``, ``--json``): the runs, time to target, accuracy, bytes per
folded update (logical, down + up), staleness and client utilization; ``--figures DIR`` draws
accuracy against virtual time and the staleness histograms (the report's figure,
:func:`fedpart.report.figures.time_and_staleness`).

    python benchmarks/fedbuff_study.py --out-root runs/fedbuff --markdown fedbuff.md --figures docs
    python benchmarks/fedbuff_study.py --size tiny   # digits, seconds a run: the test suite's check
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedpart.common.config.run_config import RunConfig, apply_overrides, config_from_dict
from fedpart.deploy.launcher import failure, run_bounded
from fedpart.report.runs import Run, read_run, read_runs

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("fedavg", "fedbabu", "fedrep")
SETTINGS = {
    "alike": {"heterogeneity.speed": "none", "heterogeneity.offline_share": 0.0},
    "heavy-tailed": {"heterogeneity.speed": "lognormal", "heterogeneity.speed_sigma": 1.0,
                     "heterogeneity.offline_share": 0.1, "heterogeneity.offline_fraction": 0.5},
}
VERSIONS_PER_ROUND = 3  # the most versions a buffered run trains per synchronous round
RUN_TIMEOUT = 7200.0


def base_settings(size: str, data_root: Path, seed: int = 0) -> tuple[dict[str, Any], int]:
    """The settings every run shares (``seed``: partition, initial model, sampling, training and
    devices), and the synchronous runs' rounds."""
    common = {
        "seed": seed, "processes": 2, "model.name": "cnn2", "sampling.fraction": 0.1,
        "train.epochs": 1, "train.batch_size": 10, "train.lr": 0.01, "train.momentum": 0.5,
        "evaluate.finetune_epochs": [5], "evaluate.lr": 0.001, "evaluate.momentum": 0.9, "evaluate.batch_size": 50,
        "checkpoint.every": 0, "server.round_timeout": 1800, "server.join_timeout": 600,
        "heterogeneity.clock": "virtual", "heterogeneity.step_seconds": 0.05,
        "heterogeneity.offline_period": 60.0,
        "buffered.concurrency": 20, "buffered.buffer_size": 10, "buffered.staleness": "polynomial",
        "buffered.staleness_exponent": 0.5,
    }
    if size == "tiny":
        return {**common, "clients": 10, "model.name": "mlp", "model.hidden": 32, "data.dataset": "digits",
                "data.partition.scheme": "shards", "data.partition.shards_per_client": 2,
                "train.batch_size": 20, "train.lr": 0.05, "buffered.concurrency": 4, "buffered.buffer_size": 2,
                "evaluate.finetune_epochs": [1], "evaluate.global_every": 1}, 3
    return {**common, "clients": 100, "data.dataset": "mnist", "data.root": str(data_root.resolve()),
            "data.options.train_samples": 20000, "data.options.test_samples": 5000,
            "data.partition.scheme": "shards", "data.partition.shards_per_client": 2}, 40


def config_of(settings: dict[str, Any]) -> RunConfig:
    return config_from_dict(apply_overrides({}, [f"{k}={json.dumps(v)}" for k, v in settings.items()]))


def timeline(config: RunConfig, last: int | None = None, coordinator: Any = None) -> list[float]:
    """The virtual time at the end of each round (sync) or version (buffered) of ``config`` run
    to round ``last`` (default ``config.rounds``) when every task completes: the engines' own
    schedule, run dry. ``coordinator``: one built for ``config`` (its plans and clock), reused."""
    from fedpart.server.engine.buffered import Schedule
    from fedpart.server.engine.coordinator import Coordinator
    from fedpart.server.engine.sampling import sample_clients

    last = last or config.rounds
    coordinator = coordinator or Coordinator(config, log=lambda line: None)  # plans and the clock; serves nothing
    clock = coordinator.clock
    clock.now = 0.0
    times = []
    if config.server.engine == "sync":
        for number in range(1, last + 1):
            clients = sample_clients(config.clients, number, config.sampling_seed, config.sampling.fraction)
            times.append(clock.sync_round(number, clients)[0])
        return times
    concurrency, buffer_size = config.buffered.resolved(config.clients, config.sampling.fraction)
    schedule = Schedule(config.clients, concurrency, buffer_size, config.sampling_seed, clock)
    for number in range(1, last + 1):
        schedule.start(number, last)
        schedule.close(schedule.members())
        times.append(clock.now)
    return times


def versions_within(settings: dict[str, Any], seconds: float, most: int) -> int:
    """The most server versions (at most ``most``) a buffered run of ``settings`` trains within
    ``seconds`` of virtual time. A run's last versions dispatch fewer tasks, so each length is run
    dry on its own (with the plans of a run of ``most`` versions: the study's schedules do not
    depend on the number of rounds)."""
    from fedpart.server.engine.coordinator import Coordinator

    config = config_of({**settings, "rounds": most})
    coordinator = Coordinator(config, log=lambda line: None)
    within = [versions for versions in range(1, most + 1) if timeline(config, versions, coordinator)[-1] <= seconds]
    return max(within, default=1)


@dataclass
class Record:
    """One run: what it is, where, and what it measured."""

    algorithm: str
    setting: str
    engine: str
    rounds: int
    out: str
    values: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def run_one(settings: dict[str, Any], out: Path) -> str | None:
    """``fedpart run`` of exactly ``settings`` into the new directory ``out``; why it failed, or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    config_path = out.parent / f"{out.name}.yaml"
    config_path.write_text(yaml.safe_dump(apply_overrides({}, [f"{k}={json.dumps(v)}" for k, v in settings.items()]),
                                          sort_keys=False))
    log = out.parent / f"{out.name}.log"
    code, _ = run_bounded([sys.executable, "-m", "fedpart", "run", str(config_path), "--out", str(out)], log,
                          RUN_TIMEOUT, cwd=REPO)
    return None if code == 0 else failure(code, RUN_TIMEOUT, log)


def measure(run: Run, expected: list[float]) -> dict[str, Any]:
    """A finished run's numbers; raises ValueError where its clock is not the dry run's."""
    recorded = [r.virtual_seconds for r in run.rounds]
    if recorded != [round(t, 6) for t in expected]:
        raise ValueError(f"{run.path}: its virtual clock {recorded[:3]}... is not the dry run's {expected[:3]}...")
    accuracy = run.summary.accuracy
    folded = sum(len(r.completed) for r in run.rounds)
    logical = sum(r.logical.down + r.logical.up for r in run.rounds)
    clients = run.config["clients"]
    staleness = run.staleness()
    values = {
        "virtual_seconds": recorded[-1],
        "personalized": accuracy.personalized[epochs].mean if (epochs := accuracy.longest_finetune()) else None,
        "initial": accuracy.initial.mean,
        "global": run.final_global_accuracy(),
        "folded": folded,
        "bytes_per_update": logical / folded,
        "logical_bytes": logical,
        "utilization": sum(r.virtual_busy for r in run.rounds) / (clients * recorded[-1]),
        "staleness": staleness,
        "mean_staleness": sum(s * n for s, n in staleness.items()) / folded if staleness else 0.0,
        "time_to_target": None,
        "accuracy_per_round": [[r.round, recorded[i], r.global_accuracy()] for i, r in enumerate(run.rounds)
                               if r.global_accuracy() is not None],
    }
    return values


def study(size: str, out_root: Path, data_root: Path, only: list[str], settings_names: list[str],
          seed: int = 0) -> list[Record]:
    """Every run of the study, in order; a run directory that exists already is read, not run again."""
    base, rounds = base_settings(size, data_root, seed)
    records = []
    for setting in settings_names:
        for algorithm in only:
            common = {**base, **SETTINGS[setting], "algorithm.name": algorithm,
                      "evaluate.global_every": base.get("evaluate.global_every", 2) if algorithm == "fedavg" else 0,
                      **({"algorithm.head_epochs": 1} if algorithm == "fedrep" else {})}
            sync = {**common, "name": f"{algorithm}_{setting}_sync", "rounds": rounds, "server.engine": "sync"}
            sync_times = timeline(config_of(sync))
            buffered = {**common, "server.engine": "buffered"}
            full = versions_within(buffered, sync_times[-1], VERSIONS_PER_ROUND * rounds)
            planned = [("sync", sync, sync_times),
                       ("buffered", {**buffered, "name": f"{algorithm}_{setting}_buffered", "rounds": full}, None)]
            if algorithm != "fedavg":  # the whole buffered run when it fits in T / 2 already
                half = versions_within(buffered, sync_times[-1] / 2, full)
                planned.append(("buffered, T/2", {**buffered, "name": f"{algorithm}_{setting}_half", "rounds": half},
                                None))
            target = None
            for engine, settings, times in planned:
                shared = engine == "buffered, T/2" and settings["rounds"] == full
                out = out_root / setting / algorithm / ("buffered" if shared else engine.replace(", T/2", "_half"))
                record = Record(algorithm, setting, engine, settings["rounds"], str(out))
                records.append(record)
                print(f"fedbuff_study: {algorithm} {setting} {engine}: {settings['rounds']} rounds -> {out}", flush=True)
                if not (out / "summary.json").is_file():
                    record.error = run_one(settings, out)
                    if record.error:
                        print(f"fedbuff_study: failed: {record.error}", flush=True)
                        continue
                try:
                    run = read_run(out)
                    record.values = measure(run, times or timeline(config_of(settings)))
                except (ValueError, KeyError, TypeError) as error:
                    record.error = f"unreadable run {out}: {error}"
                    continue
                if engine == "sync":
                    target = record.values["global"] if algorithm == "fedavg" else record.values["personalized"]
                values = record.values
                if target is None:  # the synchronous run failed: nothing to reach
                    continue
                if algorithm == "fedavg":  # the first version tested at or above the target
                    values["time_to_target"] = next((t for _, t, acc in values["accuracy_per_round"] if acc >= target),
                                                    values["virtual_seconds"] if engine == "sync" else None)
                elif engine != "buffered":  # personalized accuracy exists at a run's end only
                    values["time_to_target"] = (values["virtual_seconds"] if values["personalized"] >= target
                                                else None)
    return records


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def verdicts(records: list[Record]) -> list[str]:
    """Per algorithm and setting: how much sooner the buffered engine reached the synchronous
    run's final accuracy (FedAvg: from the global accuracy per version; FedBABU, FedRep: whether
    the run of half the time reached it)."""
    lines = []
    cells = {(r.algorithm, r.setting) for r in records}
    for algorithm, setting in sorted(cells, key=lambda c: (c[1], ALGORITHMS.index(c[0]))):
        runs = {r.engine: r for r in records if (r.algorithm, r.setting) == (algorithm, setting)}
        sync = runs.get("sync")
        if sync is None or sync.error or any(r.error for r in runs.values()):
            lines.append(f"{algorithm}, {setting}: no verdict (a run failed)")
            continue
        if algorithm == "fedavg":
            buffered = runs["buffered"].values["time_to_target"]
            target_time = sync.values["time_to_target"]
            if buffered is None:
                lines.append(f"{algorithm}, {setting}: the buffered engine did not reach "
                             f"{_percent(sync.values['global'])} % within the synchronous run's time")
            else:
                lines.append(f"{algorithm}, {setting}: global accuracy {_percent(sync.values['global'])} % reached in "
                             f"{_seconds(buffered)} s buffered against {_seconds(target_time)} s synchronous: "
                             f"{target_time / buffered:.2f}x sooner")
        else:
            half = runs["buffered, T/2"].values
            reached = half["personalized"] >= sync.values["personalized"]
            lines.append(f"{algorithm}, {setting}: personalized accuracy after {half['virtual_seconds']:,.1f} s "
                         f"buffered {_percent(half['personalized'])} % against {_percent(sync.values['personalized'])} % "
                         f"after {sync.values['virtual_seconds']:,.1f} s synchronous: "
                         + (f"reached at least {sync.values['virtual_seconds'] / half['virtual_seconds']:.2f}x sooner"
                            if reached else "not reached in half the time"))
    return lines


def markdown(records: list[Record], size: str, command: str) -> str:
    """The study's tables and verdicts."""
    header = ["algorithm", "devices", "engine", "rounds / versions", "virtual time s", "time to target s",
              "global acc %", "initial acc %", "personalized acc % (fine-tuned)", "bytes / update",
              "mean staleness", "staleness (count)", "utilization %"]
    lines = [f"Command: `{command}` (size {size}).", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for r in records:
        v = r.values
        if r.error:
            lines.append(f"| {r.algorithm} | {r.setting} | {r.engine} | {r.rounds} | failed: {r.error.splitlines()[0]} |"
                         + " |" * (len(header) - 5))
            continue
        staleness = ", ".join(f"{s}: {n}" for s, n in v["staleness"].items()) or "-"
        lines.append(f"| {r.algorithm} | {r.setting} | {r.engine} | {r.rounds} | {_seconds(v['virtual_seconds'])} | "
                     f"{_seconds(v['time_to_target'])} | {_percent(v['global'])} | {_percent(v['initial'])} | "
                     f"{_percent(v['personalized'])} | {v['bytes_per_update']:,.0f} | {v['mean_staleness']:.2f} | "
                     f"{staleness} | {_percent(v['utilization'])} |")
    lines += ["", *(f"- {line}" for line in verdicts(records))]
    return "\n".join(lines) + "\n"


def figures(records: list[Record], out: Path) -> list[Path]:
    """The report's accuracy-against-time and staleness figure, one per device setting (FedAvg)."""
    from fedpart.report.figures import time_and_staleness

    written = []
    for setting in sorted({r.setting for r in records}):
        chosen = [r for r in records if r.setting == setting and r.algorithm == "fedavg" and not r.error]
        if not chosen:
            continue
        runs = read_runs([r.out for r in chosen], [f"FedAvg {r.engine}" for r in chosen])
        target = next((r.values["global"] for r in chosen if r.engine == "sync"), None)
        plot = time_and_staleness(runs, target)
        if plot.figure is not None:
            path = out / f"fedbuff_{setting.replace('-', '_')}.png"
            plot.figure.savefig(path, format="png")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--out-root", default="runs/fedbuff", help="run directories (an existing one is read again)")
    parser.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (partition, model, sampling, devices)")
    parser.add_argument("--markdown", help="also write the tables here")
    parser.add_argument("--json", help="also write every run's numbers here")
    parser.add_argument("--figures", help="draw the figures into this folder")
    args = parser.parse_args(argv)
    records = study(args.size, Path(args.out_root).resolve(), Path(args.data_root), args.algorithms.split(","),
                    args.settings.split(","), args.seed)
    command = "python benchmarks/fedbuff_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(records, args.size, command.strip())
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in records], indent=1))
    if args.figures:
        for path in figures(records, Path(args.figures)):
            print(f"fedbuff_study: wrote {path}")
    return 1 if any(r.error for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
