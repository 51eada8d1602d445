"""``fedpart compare``: one config run once per algorithm (and per seed), then the report of those runs.

Every run is ``fedpart run`` (the local launcher) of the same config with the same ``--set``
overrides; only ``algorithm.name`` differs, plus the overrides scoped to that algorithm
(``--set fedprox:algorithm.mu=0.1``). So seed, partition, sampled clients, learning-rate schedule
and evaluation protocol are the same by construction. The runs go one after another, each into
``OUT/<algorithm>/``; the report goes to ``OUT/report/``. Everything is validated, and every
output directory checked to be new, before the first run starts: an earlier run is never touched.

With ``seeds`` every algorithm runs once per seed S, into ``OUT/<algorithm>/seed<S>/``, with
``seeds.init``, ``seeds.sampling`` and ``seeds.training`` set to S: the initial model, the sampled
clients and the training randomness vary, over one partition (``seeds.partition``, or the
config's ``seed``); ``vary_partition`` also sets ``seed`` to S, so that the partition varies too.
The runs of one seed are the same for every algorithm; the report groups each algorithm's runs.

With ``engines`` (``sync,buffered``) every algorithm (and seed) runs once per round engine
(``server.engine``), into ``OUT/<algorithm>/<engine>/`` (``.../<engine>/seed<S>/``): the same config,
partition, devices and seeds, so the report sets the synchronous and the buffered engine side by
side (the ``buffered`` section is read by the buffered engine only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedpart.common.config.run_config import ConfigError, RunConfig, load_config
from fedpart.report.link import Link
from fedpart.report.runs import ReportError

if TYPE_CHECKING:
    from fedpart.deploy.forks import Command

REPORT_DIR = "report"


VARIED_SEEDS = ("init", "sampling", "training")  # what --seeds varies over one partition
ENGINES = ("sync", "buffered")


@dataclass
class PlannedRun:
    algorithm: str
    overrides: list[str]
    config: RunConfig
    out: Path
    seed: int | None = None  # the --seeds value of this run (None: compare without --seeds)
    engine: str | None = None  # the --engines value of this run (None: compare without --engines)

    @property
    def label(self) -> str:
        name = self.algorithm if self.engine is None else f"{self.algorithm} {self.engine}"
        return name if self.seed is None else f"{name} seed {self.seed}"


def parse_algorithms(text: str) -> list[str]:
    """``fedavg,fedbabu`` -> ["fedavg", "fedbabu"]; at least one, none twice."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("--algorithms: give at least one algorithm, e.g. --algorithms fedavg,fedbabu")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"--algorithms names {', '.join(repeated)} twice")
    return names


def parse_seeds(text: str) -> list[int]:
    """``0,1,2`` -> [0, 1, 2]; at least one, none twice, each a non-negative integer."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: comma-separated integers, e.g. --seeds 0,1,2") from None
    if not seeds or any(seed < 0 for seed in seeds):
        raise ConfigError(f"--seeds {text!r}: at least one non-negative integer, e.g. --seeds 0,1,2")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r} names a seed twice")
    return seeds


def parse_engines(text: str) -> list[str]:
    """``sync,buffered`` -> ["sync", "buffered"]: round engines, none twice."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if not engines or unknown or len(set(engines)) != len(engines):
        raise ConfigError(f"--engines {text!r}: comma-separated round engines out of {', '.join(ENGINES)}, none twice, "
                          "e.g. --engines sync,buffered")
    return engines


def seed_overrides(seed: int, vary_partition: bool) -> list[str]:
    """The ``--set`` values that make a run of ``seed``: its initialisation, sampling and training
    seeds, and with ``vary_partition`` the run's ``seed`` (the partition's, where
    ``seeds.partition`` is unset)."""
    return [*(f"seeds.{source}={seed}" for source in VARIED_SEEDS), *([f"seed={seed}"] if vary_partition else [])]


def split_overrides(sets: list[str], algorithms: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``--set`` values for every run, and those scoped to one algorithm (``ALGORITHM:KEY=VALUE``:
    a colon before the first ``=``)."""
    common: list[str] = []
    scoped: dict[str, list[str]] = {a: [] for a in algorithms}
    for text in sets:
        key = text.split("=", 1)[0]
        if ":" not in key:
            if key.strip() == "algorithm.name":
                raise ConfigError("--set algorithm.name: compare sets the algorithm of each run from --algorithms")
            common.append(text)
            continue
        algorithm, _, setting = text.partition(":")
        if algorithm not in scoped:
            raise ConfigError(f"--set {text}: {algorithm!r} is not one of --algorithms ({', '.join(algorithms)})")
        scoped[algorithm].append(setting)
    return common, scoped


def plan_runs(config_path: Path, algorithms: list[str], sets: list[str], out: Path,
              seeds: list[int] | None = None, vary_partition: bool = False,
              engines: list[str] | None = None) -> list[PlannedRun]:
    """Every run's config, validated (algorithm options included), and its new run directory:
    one run per algorithm, and per seed with ``seeds``, and per round engine with ``engines``."""
    from fedpart.common.config.experiment import run_algorithm

    if vary_partition and seeds is None:
        raise ConfigError("--vary-partition varies the partition with each of --seeds: give --seeds too")
    common, scoped = split_overrides(sets, algorithms)
    if seeds is not None:
        seed_keys = {*(f"seeds.{source}" for source in VARIED_SEEDS),
                     *(("seed", "seeds.partition") if vary_partition else ())}
        clashing = [text for text in sets if text.split("=", 1)[0].split(":")[-1].strip() in seed_keys]
        if clashing:
            raise ConfigError(f"--set {clashing[0]}: --seeds sets the seeds of each run")
    if engines is not None:
        clashing = [text for text in sets if text.split("=", 1)[0].split(":")[-1].strip() == "server.engine"]
        if clashing:
            raise ConfigError(f"--set {clashing[0]}: --engines sets the round engine of each run")
    planned = []
    for algorithm in algorithms:
        for engine in engines if engines is not None else [None]:
            for seed in seeds if seeds is not None else [None]:
                extra = seed_overrides(seed, vary_partition) if seed is not None else []
                chosen = [f"server.engine={engine}"] if engine is not None else []
                overrides = [*common, f"algorithm.name={algorithm}", *scoped[algorithm], *chosen, *extra]
                try:
                    config = load_config(config_path, overrides)
                    run_algorithm(config)
                except (ConfigError, ValueError, TypeError) as error:
                    raise ConfigError(f"{algorithm}{f' ({engine})' if engine else ''}: {error} (to set an option for "
                                      "one algorithm only: --set ALGORITHM:algorithm.OPTION=VALUE)") from error
                run_dir = out / algorithm / (engine or "") / (f"seed{seed}" if seed is not None else "")
                if run_dir.exists():
                    raise ConfigError(f"{run_dir} exists: compare never writes into an earlier run; choose another "
                                      "--out")
                planned.append(PlannedRun(algorithm, overrides, config, run_dir, seed, engine))
    report_dir = out / REPORT_DIR
    if report_dir.exists():
        raise ConfigError(f"{report_dir} exists: choose another --out")
    return planned


def compare(config_path: Path, algorithms: list[str], sets: list[str], out: Path, link: Link | None,
            target: float | None, command: Command, seeds: list[int] | None = None, vary_partition: bool = False,
            engines: list[str] | None = None) -> int:
    """Run every algorithm (once per seed with ``seeds``, per round engine with ``engines``), each
    a ``fedpart run`` whose processes run ``command`` (the ``fedpart`` command's entry), then write
    the report; 0 only when every run succeeded."""
    from fedpart.deploy.launcher import run_local
    from fedpart.report.build import require_plotting, write_report

    require_plotting()
    planned = plan_runs(config_path, algorithms, sets, out, seeds, vary_partition, engines)
    codes = {}
    for run in planned:
        print(f"fedpart compare: {run.label} -> {run.out}", flush=True)
        codes[run.label] = run_local(config_path, run.overrides, run.config, str(run.out), command)
    failed = [label for label, code in codes.items() if code != 0]
    reportable = [r for r in planned if (r.out / "config.yaml").is_file()]
    for run in planned:
        if run not in reportable:
            print(f"fedpart compare: {run.label} left no run directory to report", flush=True)
    if reportable:
        try:
            report = write_report([r.out for r in reportable], out / REPORT_DIR, link, target,
                                  labels=[r.label for r in reportable])
            print(f"fedpart compare: report {report.page}", flush=True)
        except ReportError as error:
            print(f"fedpart compare: error: no report: {error}", flush=True)
            return 1
    if failed:
        print(f"fedpart compare: error: runs failed: {', '.join(f'{label} (exit {codes[label]})' for label in failed)}",
              flush=True)
        return 1
    return 0
