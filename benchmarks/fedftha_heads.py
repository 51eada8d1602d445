"""FedFTHA's global model under two-class label skew: why FedHA's averaged head trails FedAvg.

In the ``fedftha`` study of ``benchmarks/reproduce.py`` (lenet5 on MNIST, 20 clients with 2 label
shards each, fraction 0.2) FedFTHA's global model -- the global body with FedHA's head, the
sample-weighted mean of the latest head each client uploaded -- trails FedAvg's by 12 to 14
points, where the FedFTHA paper claims it does better. This script measures where the gap comes
from, in two steps:

- ``run`` makes seed-paired FedFTHA and FedAvg runs (same seed: same partition, initial model and
  sampled clients) of the study under a few changes of its setting, through ``reproduce.py``'s
  :func:`run_one`, and tabulates both runs' global accuracy (``summary.json``) and their
  difference per seed. Settings: ``base`` (the study), ``tau_head0`` (FedFTHA uploads its head
  right after the joint epochs, no head-only epochs; paired with ``base``'s FedAvg run, which
  that change does not touch), ``shards5`` (5 label shards per client: milder skew) and
  ``every_client`` (fraction 1.0, 8 rounds and a global test every 2 rounds, whatever
  ``--rounds`` says: every client uploads a fresh head every round). A run whose directory
  already holds a finished run of the same settings is read, not run again.
- ``analyse`` tests the final global body of a finished FedFTHA run offline on the server's test
  split with other heads made from the heads the server stored (``server_state``): their
  sample-weighted mean (FedHA's head, what the run reports), their uniform mean, the uniform mean
  of the last round's heads only, a class-wise mean (row k of the head from the heads of the
  clients whose train split holds class k), each personal head alone; and with a linear head fit
  centrally on the whole train split (L-BFGS, a probe of the body), next to the same probe on the
  paired FedAvg run's body. It also gives the share of test inputs of the classes a client does
  not hold that its personal head assigns to its own classes, and the global model's weakest
  classes with how many clients hold each.

Commands (docs/results.md, FedFTHA study)::

    python benchmarks/fedftha_heads.py run --settings base,tau_head0,shards5,every_client \\
        --seeds 0,1 --out-root runs/fedftha_heads
    python benchmarks/fedftha_heads.py analyse FEDFTHA_RUN FEDAVG_RUN
    python benchmarks/fedftha_heads.py analyse --pair FEDFTHA_RUN,FEDAVG_RUN --pair ...

Run directories follow ``reproduce.py``'s layout:
``OUT_ROOT/fedftha_SETTING/seedS/shards2/{FedFTHA,FedAvg}`` (``tau_head0`` has no FedAvg run of its
own: it pairs with ``base``'s); ``run`` ends with the ``analyse`` command of the pairs it made.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import yaml

from fedpart.common.process.checkpoint import load_tensors
from fedpart.common.config.run_config import RunConfig, apply_overrides, load_config
from fedpart.common.data.datasets import load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.ml.evaluation import EVAL_BATCH
from fedpart.common.config.experiment import build_run_model
from fedpart.common.process.records import read_rounds, read_summary
from fedpart.common.ml.split_model import SplitModel
from fedpart.server.policy.aggregation import WeightedMean

REPRODUCE = Path(__file__).resolve().with_name("reproduce.py")
PROBE_ITERATIONS = 200  # L-BFGS iterations of the linear probe

Head = dict[str, torch.Tensor]


def load_reproduce() -> ModuleType:
    """``benchmarks/reproduce.py`` as the module ``reproduce`` (it is a script, not a package)."""
    if "reproduce" in sys.modules:
        return sys.modules["reproduce"]
    spec = importlib.util.spec_from_file_location("reproduce", REPRODUCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ run


@dataclass(frozen=True)
class Setting:
    """A change of the ``fedftha`` study: settings of both runs of a pair, and of FedFTHA's alone."""

    name: str
    text: str
    shared: dict[str, Any] = field(default_factory=dict)
    fedftha_only: dict[str, Any] = field(default_factory=dict)


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("base", "the study: 2 shards per client, fraction 0.2"),
    Setting("tau_head0", "2 shards per client, fraction 0.2, tau_head = 0 (heads uploaded right after the "
            "joint epochs)", fedftha_only={"algorithm.tau_head": 0}),
    Setting("shards5", "5 shards per client, fraction 0.2",
            shared={"data.partition": {"scheme": "shards", "shards_per_client": 5}}),
    Setting("every_client", "2 shards per client, every client every round (fraction 1.0)",
            shared={"sampling.fraction": 1.0, "rounds": 8, "evaluate.global_every": 2}),
)}


def fedavg_setting(setting: Setting) -> Setting:
    """The setting whose FedAvg run pairs with ``setting``'s FedFTHA run: the first with the same
    shared settings and no FedFTHA-only change (which leaves FedAvg's run as it is), else itself."""
    return next((s for s in SETTINGS.values() if s.shared == setting.shared and not s.fedftha_only), setting)


@dataclass
class PairResult:
    """One seed of one setting: each run's directory and final global accuracy (None: failed)."""

    setting: str
    seed: int
    fedftha: Path
    fedavg: Path
    fedftha_global: float | None
    fedavg_global: float | None


def _planned_config(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The config ``reproduce.run_one`` writes for ``settings``."""
    return apply_overrides({}, [f"{key}={json.dumps(value)}" for key, value in settings.items()])


def _finished(out: Path, settings: Mapping[str, Any]) -> bool:
    """Whether ``out`` holds a finished run of ``settings`` (its name aside, which names the study).
    Raises ``ValueError`` where it holds a finished run of other settings."""
    config_path = out.parent / f"{out.name}.yaml"
    if not (out / "summary.json").is_file() or not config_path.is_file():
        return False
    written = {k: v for k, v in yaml.safe_load(config_path.read_text()).items() if k != "name"}
    planned = {k: v for k, v in _planned_config(settings).items() if k != "name"}
    if written != planned:
        raise ValueError(f"{out} holds a finished run of other settings ({config_path}); use another --out-root")
    return True


def _global_accuracy(out: Path) -> float | None:
    return read_summary(out / "summary.json").global_accuracy()


def run_pairs(settings: Sequence[str], seeds: Sequence[int], out_root: Path, size: str, rounds: int,
              data_root: Path, timeout: float) -> list[PairResult]:
    """FedFTHA and FedAvg of every setting and seed (seed-major), each run made unless its
    directory already holds it; FedAvg runs shared between settings are made once."""
    reproduce = load_reproduce()
    study = reproduce.STUDIES["fedftha"](size)
    cell = study.cells[0]
    variants = {v.label: v for v in cell.variants}
    results = []
    for seed in seeds:
        for name in settings:
            setting = SETTINGS[name]
            fedftha = replace(variants["FedFTHA"], settings={**variants["FedFTHA"].settings, **setting.fedftha_only})
            accuracies, directories = {}, {}
            for variant, home in ((fedftha, setting), (variants["FedAvg"], fedavg_setting(setting))):
                named = replace(study, name=f"fedftha_{home.name}")
                run_settings = reproduce.run_settings(named, cell, variant, seed, data_root,
                                                      {"rounds": rounds, **home.shared})
                out = reproduce.run_directory(out_root, named, seed, cell, variant)
                directories[variant.label] = out
                if _finished(out, run_settings):
                    print(f"{named.name} seed {seed} {variant.label}: finished before, read from {out}", flush=True)
                    accuracies[variant.label] = _global_accuracy(out)
                    continue
                record = reproduce.run_one(named, cell, variant, seed, out, run_settings, timeout)
                status = "FAILED: " + record.error if record.error else "ok"
                print(f"{named.name} seed {seed} {variant.label}: {record.wall_seconds:.1f} s, {status}", flush=True)
                accuracies[variant.label] = None if record.error else _global_accuracy(out)
            results.append(PairResult(name, seed, directories["FedFTHA"], directories["FedAvg"],
                                      accuracies["FedFTHA"], accuracies["FedAvg"]))
    return results


def _percent(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "failed"
    return f"{value * 100:+.2f}" if sign else f"{value * 100:.2f}"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def pairs_table(results: Sequence[PairResult], rounds: int) -> str:
    """One row per setting: its seeds, both global accuracies and FedFTHA - FedAvg per seed."""
    rows = []
    for name in dict.fromkeys(r.setting for r in results):
        setting = SETTINGS[name]
        mine = [r for r in results if r.setting == name]
        differences = [None if r.fedftha_global is None or r.fedavg_global is None
                       else r.fedftha_global - r.fedavg_global for r in mine]
        rows.append([f"{setting.text}, {setting.shared.get('rounds', rounds)} rounds",
                     ", ".join(str(r.seed) for r in mine),
                     ", ".join(_percent(r.fedftha_global) for r in mine),
                     ", ".join(_percent(r.fedavg_global) for r in mine),
                     ", ".join(_percent(d, sign=True) for d in differences)])
    return _markdown(["setting", "seeds", "FedHA global %", "FedAvg global %", "FedFTHA - FedAvg, points"], rows)


# -------------------------------------------------------------------------------------- analyse


ROWS: dict[str, str] = {
    "weighted": "the stored heads' sample-weighted mean (FedHA's head, as reported)",
    "uniform": "their uniform mean",
    "last_round": "the uniform mean of the last round's heads only",
    "classwise": "per class k, the mean of row k over the heads of the clients holding class k",
    "personal": "one personal head alone (mean over the clients with a stored head)",
    "probe": "a linear head fit on the whole train split",
    "fedavg_probe": "the same probe on FedAvg's final body",
    "fedavg_global": "FedAvg's final global model (its own head), for comparison",
    "own_classes": "test inputs of the classes a client does not hold that its personal head assigns "
                   "to its own classes",
}


@dataclass
class HeadAnalysis:
    """What :func:`analyse_pair` measured on one FedFTHA / FedAvg pair (accuracies as fractions)."""

    label: str
    rows: dict[str, float]                 # ROWS key -> fraction (nan where nothing to measure)
    reported: float | None                 # the FedFTHA run's global accuracy in its summary.json
    fedftha_per_class: list[float]
    fedavg_per_class: list[float]
    holders: list[int]                     # clients whose train split holds each class
    clients: int


@dataclass
class FinalState:
    """A finished run's final global state, and FedHA's stored heads where the run has them."""

    global_state: dict[str, torch.Tensor]
    heads: dict[int, Head]
    head_weights: dict[int, float]


def read_final_state(run: Path) -> FinalState:
    """The last round's tensors from the run's ``server_state`` (``fedpart.server.engine.run_state``)."""
    state = json.loads((run / "server_state" / "state.json").read_text())
    tensors = load_tensors(run / "server_state" / state["tensors"])
    heads: dict[int, Head] = {}
    for key, tensor in tensors.items():
        if key.startswith("heads/"):
            client, name = key[len("heads/"):].split("/", 1)
            heads.setdefault(int(client), {})[name] = tensor
    return FinalState({k[len("global/"):]: v for k, v in tensors.items() if k.startswith("global/")}, heads,
                      {int(c): float(w) for c, w in state["head_weights"].items()})


def weighted_mean(heads: Mapping[int, Head], weights: Mapping[int, float]) -> Head:
    """The heads' weighted mean as the server forms FedHA's head (``WeightedMean``, client order)."""
    mean = WeightedMean()
    for client in sorted(heads):
        mean.add(heads[client], weights[client])
    return mean.result()


def classwise_mean(heads: Mapping[int, Head], classes: Mapping[int, set[int]], num_classes: int) -> Head:
    """Row k of every head tensor: the uniform mean of row k over the stored heads of the clients
    holding class k (over all stored heads where none of them does)."""
    out = {}
    for name in next(iter(heads.values())):
        rows = []
        for k in range(num_classes):
            holders = [c for c in heads if k in classes[c]] or list(heads)
            rows.append(torch.stack([heads[c][name][k] for c in holders]).mean(0))
        out[name] = torch.stack(rows)
    return out


def predictions(model: SplitModel, state: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The predicted class of every input under ``state``."""
    model.load_state_dict(dict(state))
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x[i:i + EVAL_BATCH]).argmax(1) for i in range(0, x.shape[0], EVAL_BATCH)])


def body_features(model: SplitModel, state: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    model.load_state_dict(dict(state))
    model.eval()
    with torch.no_grad():
        return torch.cat([model.features(x[i:i + EVAL_BATCH]) for i in range(0, x.shape[0], EVAL_BATCH)])


def probe_accuracy(model: SplitModel, state: Mapping[str, torch.Tensor], x_train: torch.Tensor,
                   y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int) -> float:
    """Test accuracy of a linear head fit by L-BFGS on the body's features of the train split."""
    train, test = body_features(model, state, x_train), body_features(model, state, x_test)
    torch.manual_seed(0)
    head = torch.nn.Linear(train.shape[1], num_classes)
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=PROBE_ITERATIONS)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(train), y_train)
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float((head(test).argmax(1) == y_test).float().mean())


def _accuracy(predicted: torch.Tensor, y: torch.Tensor) -> float:
    return float((predicted == y).float().mean())


def _per_class(predicted: torch.Tensor, y: torch.Tensor, num_classes: int) -> list[float]:
    return [_accuracy(predicted[y == k], y[y == k]) if bool((y == k).any()) else math.nan
            for k in range(num_classes)]


def _pair_label(config: RunConfig) -> str:
    partition = config.data.partition
    text = (f"{partition.options['shards_per_client']} shards" if partition.scheme == "shards"
            else partition.scheme)
    return f"{text}, seed {config.seed}"


def analyse_pair(fedftha_run: Path, fedavg_run: Path) -> HeadAnalysis:
    """The final global body of ``fedftha_run`` with every head of :data:`ROWS`, on the server's
    test split, and the probe on both runs' bodies. Raises ``ValueError`` when the two runs do not
    share data, partition and clients, or the FedFTHA run stored no heads."""
    config = load_config(fedftha_run / "config.yaml")
    paired = load_config(fedavg_run / "config.yaml")
    for key in ("data", "clients"):
        if config.to_dict()[key] != paired.to_dict()[key]:
            raise ValueError(f"{fedftha_run} and {fedavg_run} differ in {key}: not a pair")
    if config.partition_seed != paired.partition_seed:
        raise ValueError(f"{fedftha_run} and {fedavg_run} have other partition seeds: not a pair")
    ftha, avg = read_final_state(fedftha_run), read_final_state(fedavg_run)
    if not ftha.heads:
        raise ValueError(f"{fedftha_run} stored no heads (server_state): not a FedFTHA run")
    data = config.data
    dataset = load_dataset(data.dataset, data.root, **data.options)
    num_classes = dataset.num_classes
    splits = make_partition(dataset.y_train, dataset.y_test, config.clients, data.partition.scheme,
                            config.partition_seed, num_classes=num_classes, **data.partition.options)
    classes = {c: set(np.asarray(dataset.y_train)[split.train].tolist()) for c, split in enumerate(splits)}
    x_train, y_train = dataset.features(dataset.x_train), dataset.targets(dataset.y_train)
    x_test, y_test = dataset.features(dataset.x_test), dataset.targets(dataset.y_test)
    model = build_run_model(config)
    body = ftha.global_state

    def with_head(head: Head) -> dict[str, torch.Tensor]:
        return {**body, **{name: value.to(body[name].dtype) for name, value in head.items()}}

    def accuracy_with(head: Head) -> float:
        return _accuracy(predictions(model, with_head(head), x_test), y_test)

    last = max(read_rounds(fedftha_run / "metrics.jsonl"), key=lambda m: m.round)
    last_round = {c: ftha.heads[c] for c in last.completed if c in ftha.heads}
    personal, own_classes = [], []
    for client, head in ftha.heads.items():
        predicted = predictions(model, with_head(head), x_test)
        personal.append(_accuracy(predicted, y_test))
        held = torch.tensor(sorted(classes[client]))
        foreign = ~torch.isin(y_test, held)
        if bool(foreign.any()):
            own_classes.append(float(torch.isin(predicted[foreign], held).float().mean()))
    rows = {
        "weighted": accuracy_with(weighted_mean(ftha.heads, ftha.head_weights)),
        "uniform": accuracy_with(weighted_mean(ftha.heads, {c: 1.0 for c in ftha.heads})),
        "last_round": (accuracy_with(weighted_mean(last_round, {c: 1.0 for c in last_round}))
                       if last_round else math.nan),
        "classwise": accuracy_with(classwise_mean(ftha.heads, classes, num_classes)),
        "personal": float(np.mean(personal)),
        "probe": probe_accuracy(model, body, x_train, y_train, x_test, y_test, num_classes),
        "fedavg_probe": probe_accuracy(model, avg.global_state, x_train, y_train, x_test, y_test, num_classes),
        "fedavg_global": _accuracy(predictions(model, avg.global_state, x_test), y_test),
        "own_classes": float(np.mean(own_classes)) if own_classes else math.nan,
    }
    summary = read_summary(fedftha_run / "summary.json")
    return HeadAnalysis(
        label=_pair_label(config), rows=rows, reported=summary.global_accuracy(),
        fedftha_per_class=_per_class(predictions(model, body, x_test), y_test, num_classes),
        fedavg_per_class=_per_class(predictions(model, avg.global_state, x_test), y_test, num_classes),
        holders=[sum(k in held for held in classes.values()) for k in range(num_classes)],
        clients=config.clients)


def heads_table(analyses: Sequence[HeadAnalysis]) -> str:
    """One row per :data:`ROWS` entry, one column per pair, in percent ("-": nothing to measure)."""
    rows = [[text] + ["-" if math.isnan(a.rows[key]) else f"{a.rows[key] * 100:.2f}" for a in analyses]
            for key, text in ROWS.items()]
    return _markdown(["final global body of the FedFTHA run, with (%)"] + [a.label for a in analyses], rows)


def weakest_classes(analysis: HeadAnalysis, count: int) -> str:
    """The ``count`` classes the FedFTHA global model gets least right, with FedAvg's accuracy on
    them and how many clients hold each."""
    order = sorted((k for k, v in enumerate(analysis.fedftha_per_class) if not math.isnan(v)),
                   key=lambda k: analysis.fedftha_per_class[k])[:count]
    parts = [f"class {k} ({analysis.holders[k]} of {analysis.clients} clients hold it): FedFTHA "
             f"{analysis.fedftha_per_class[k] * 100:.1f} %, FedAvg {analysis.fedavg_per_class[k] * 100:.1f} %"
             for k in order]
    return f"{analysis.label}: " + "; ".join(parts)


# ----------------------------------------------------------------------------------------- main


def _pair(text: str) -> tuple[Path, Path]:
    fedftha, sep, fedavg = text.partition(",")
    if not sep or not fedftha or not fedavg:
        raise argparse.ArgumentTypeError(f"--pair {text!r}: expected FEDFTHA_RUN,FEDAVG_RUN")
    return Path(fedftha), Path(fedavg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="make seed-paired FedFTHA / FedAvg runs and tabulate their global accuracy")
    run.add_argument("--settings", default=",".join(SETTINGS),
                     help=f"comma-separated, any of {', '.join(SETTINGS)} (default: all)")
    run.add_argument("--seeds", default="0,1", help="comma-separated seeds (default: %(default)s)")
    run.add_argument("--out-root", type=Path, required=True, help="run directories go here (finished ones are read)")
    run.add_argument("--rounds", type=int, default=20,
                     help="rounds of every setting but every_client, which has 8 (default: %(default)s)")
    run.add_argument("--size", choices=("full", "tiny"), default="full",
                     help="the study's size (reproduce.py): full (MNIST, default) or tiny (digits)")
    run.add_argument("--data-root", type=Path, default=load_reproduce().default_data_root(),
                     help="holds MNIST/raw/*.gz (default: %(default)s)")
    run.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take (default: %(default)s)")
    analyse = commands.add_parser("analyse", help="test a finished pair's final FedFTHA body with other heads")
    analyse.add_argument("runs", nargs="*", type=Path, metavar="RUN", help="FEDFTHA_RUN FEDAVG_RUN")
    analyse.add_argument("--pair", dest="pairs", action="append", type=_pair, default=[],
                         metavar="FEDFTHA_RUN,FEDAVG_RUN", help="a further pair (repeatable): one column each")
    analyse.add_argument("--weakest", type=int, default=3, help="classes listed per pair (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.command == "run":
        args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
        unknown = [s for s in args.settings if s not in SETTINGS]
        if unknown or not args.settings:
            parser.error(f"--settings {unknown or args.settings}: any of {', '.join(SETTINGS)}")
        try:
            args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--seeds {args.seeds!r}: comma-separated integers")
        if not args.seeds or args.rounds < 1:
            parser.error("give at least one seed and one round")
    else:
        if len(args.runs) not in (0, 2):
            parser.error("analyse: give FEDFTHA_RUN FEDAVG_RUN, or --pair")
        args.pairs = ([tuple(args.runs)] if args.runs else []) + args.pairs
        if not args.pairs:
            parser.error("analyse: give FEDFTHA_RUN FEDAVG_RUN, or --pair")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "analyse":
        try:
            analyses = [analyse_pair(fedftha, fedavg) for fedftha, fedavg in args.pairs]
        except (OSError, ValueError, KeyError) as error:
            print(f"fedftha_heads.py: {error}", file=sys.stderr)
            return 2
        print(heads_table(analyses))
        print("\nWeakest classes of FedFTHA's global model (FedHA's head):")
        for analysis in analyses:
            print("- " + weakest_classes(analysis, args.weakest))
        return 0
    try:
        results = run_pairs(args.settings, args.seeds, args.out_root, args.size, args.rounds, args.data_root,
                            args.timeout)
    except ValueError as error:
        print(f"fedftha_heads.py: {error}", file=sys.stderr)
        return 2
    print("\n" + pairs_table(results, args.rounds))
    print("\nThe final models of these pairs, head by head:\n\npython benchmarks/fedftha_heads.py analyse "
          + " ".join(f"--pair {r.fedftha},{r.fedavg}" for r in results))
    failed = any(r.fedftha_global is None or r.fedavg_global is None for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
