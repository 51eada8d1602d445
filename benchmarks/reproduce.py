"""The seed papers' empirical claims, reproduced in kind through the real system (issue 9).

Each *study* is a small grid of real ``fedpart run`` invocations (one server and its client
processes on 127.0.0.1, a fresh run directory each, nothing reused between runs except what a
variant states: LG-FedAvg starts from the FedAvg run of the same cell and seed, as in FedBABU's
code). The numbers come from the run directories through ``fedpart report``'s reader; a table
gives mean +- std over seeds, and each claim of the paper gets a one-line verdict from paired
differences (same seed = same partition, initial model and sampled clients):

- *reproduced*: the claimed difference has the claimed sign in every seed;
- *not reproduced*: its mean over seeds has the opposite sign (or is zero);
- *inconclusive*: the mean has the claimed sign but some seed disagrees.

Studies (``python benchmarks/reproduce.py STUDY [STUDY ...]``; docs/results.md has the tables):

- ``fedbabu`` (Oh et al., ICLR 2022): FedAvg, FedBABU, FedPer, LG-FedAvg, FedRep under 2-shard
  heterogeneity for local epochs tau in {1, 4, 10} with the paper's optimizer (SGD lr 0.1 momentum
  0.9 batch 50, lr x0.1 at 50 % and 75 % of the rounds, rounds = E / tau) and fine-tuning protocol
  (full model, lr 1e-3 momentum 0.9 batch 50, tau_f in 0..5 and 10); initial, personalized,
  head-less accuracy.
- ``layer_expansion`` (Jang & Choi 2024): Vanilla and Anti against FedAvg and FedBABU at equal
  rounds under Dirichlet 0.1 (cnn2, fraction 0.1, batch 10, lr 0.005, units unfrozen at thirds of
  the rounds): accuracy against cumulative bytes and training FLOPs.
- ``fedbug`` (Kao & Wang 2023): FedBug with GU ratio 0.2 and 0.4 against FedAvg under Dirichlet
  0.3 class priors (participation 0.1, 5 local epochs, lr 0.1, wd 1e-3, batch 50, clip 10): global
  accuracy.
- ``fedftha``: FedFTHA's global model (global body + FedHA's averaged head) against FedAvg's, and
  its personalized accuracy against FedPer and FedRep (20 clients, fraction 0.2, lr 0.01 momentum
  0.5, batch 10, tau_sync 5, tau_head 5).

``--size tiny`` runs every study's full grid of rows on scikit-learn's digits for a round or two
(the test suite's check that the studies run end to end); ``--size full`` (default) is the
documented study on real MNIST, sized to minutes per run on two CPU cores.

``--lrs 0.01,0.03,0.1`` sweeps a study over the local learning rate: every cell is run at each
rate (a variant that sets its own rate, such as LG-FedAvg's 1e-3, keeps it) and every claim gets
a verdict per rate, plus one with each algorithm at its own best rate. A verdict never rests on a
run that did not train: a run is *marked* (:func:`mark_runs`) when it diverged (a non-finite
training loss or accuracy), collapsed (its model's accuracy within 5 points of chance) or, in a
sweep, is under-trained (more than 15 points below the same variant at its best rate in the same
cell and seed); a marked run's seed drops out of every pairing it is in, and the verdict says so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fedpart.common.config.run_config import apply_overrides
from fedpart.deploy.launcher import failure, run_bounded
from fedpart.report.runs import ReportError, Run, read_run

REPO = Path(__file__).resolve().parents[1]
SIZES = ("full", "tiny")
CHANCE_MARGIN = 0.05      # a model within 5 points of chance accuracy collapsed
UNDERTRAINED_GAP = 0.15   # more than 15 points below its best learning rate: under-trained
FINETUNE_SWEEP = [0, 1, 2, 3, 4, 5, 10]  # FedBABU's personalization-speed curve (tau_f)


def default_data_root() -> Path:
    """``<checkout>/../shared/data``: the real MNIST copy beside the repository."""
    return REPO.parent / "shared" / "data"


# ------------------------------------------------------------------------------------- studies


@dataclass(frozen=True)
class Variant:
    """One row of a cell: a label and the settings that make the run. ``start_from`` names the
    variant of the same cell and seed whose final global model this run starts from."""

    label: str
    settings: dict[str, Any]
    start_from: str | None = None


@dataclass(frozen=True)
class Cell:
    """One point of a study's grid (e.g. ``tau=4``): its own settings and its variants. In a
    learning-rate sweep ``origin`` is the key of the unswept cell and ``lr`` this cell's rate."""

    key: str
    settings: dict[str, Any]
    variants: tuple[Variant, ...]
    origin: str | None = None
    lr: float | None = None


@dataclass(frozen=True)
class Column:
    """A table column: a measured quantity (key of :func:`measure`), its title and format."""

    key: str
    title: str
    scale: float = 1.0
    digits: int = 2


@dataclass(frozen=True)
class Claim:
    """A paper's claim as a paired comparison: in cell ``cell``, ``better`` beats ``worse`` on
    ``metric`` (larger is better unless ``lower``). ``worse_metric`` lets the baseline be measured
    by another quantity (e.g. a personal model's best of its own and its fine-tuned accuracy)."""

    text: str
    cell: str
    metric: str
    better: str
    worse: str
    lower: bool = False
    worse_metric: str | None = None
    worse_cell: str | None = None  # the baseline's cell when it differs (each variant at its best rate)


@dataclass(frozen=True)
class Study:
    """One paper's claims: the grid of runs (cells x variants, repeated per seed), the columns of
    its table and the claims checked on the results."""

    name: str
    paper: str
    setting: str                      # one paragraph: what the runs share, and why these sizes
    base: dict[str, Any]              # settings of every run
    cells: tuple[Cell, ...]
    columns: tuple[Column, ...]
    claims: tuple[Claim, ...]
    trend_claims: tuple[tuple[str, Claim, Claim], ...] = ()  # (text, small-cell claim, large-cell claim)
    curve_columns: tuple[Column, ...] = ()  # an extra table (FedBABU's tau_f sweep)
    curve_title: str = ""
    per_round: bool = False          # also tabulate accuracy vs cumulative bytes / FLOPs per round
    classes: int = 10                # of the data (chance accuracy = 1 / classes)
    lrs: tuple[float, ...] = ()      # the swept learning rates (empty: no sweep)


def _percent(key: str, title: str) -> Column:
    return Column(key, title, scale=100.0)


def _data_text(base: dict[str, Any]) -> str:
    """``cnn4 on MNIST (3000 train / 2500 test samples), 50 clients, 3 rounds``-style summary."""
    options = base.get("data.options", {})
    sizes = (f" ({options['train_samples']} train / {options['test_samples']} test samples)"
             if "train_samples" in options else "")
    rounds = f", {base['rounds']} rounds" if "rounds" in base else ""
    return f"{base['model.name']} on {base['data.dataset']}{sizes}, {base['clients']} clients{rounds}"


def _sampling_text(base: dict[str, Any]) -> str:
    if "sampling.probability" in base:
        return f"each client taking part with probability {base['sampling.probability']}"
    return f"fraction {base['sampling.fraction']} of the clients per round"


def _fedbabu(size: str) -> Study:
    """FedBABU vs FedAvg / FedPer / LG-FedAvg / FedRep over local epochs tau (the paper's Table 2,
    4 and 6 in kind): 2 shards per client, f such that 10 clients train per round."""
    if size == "full":
        data = {"data.dataset": "mnist", "data.options": {"normalize": True, "train_samples": 3000,
                                                           "test_samples": 2500},
                "model.name": "cnn4", "clients": 50, "sampling.fraction": 0.2, "processes": 2}
        epochs_total = 60  # rounds x tau, as the paper's 320 = rounds x tau
    else:
        data = {"data.dataset": "digits", "data.options": {}, "model.name": "mlp", "model.hidden": 32,
                "clients": 10, "sampling.fraction": 0.5, "processes": 1}
        epochs_total = 2
    base = {**data,
            "data.partition": {"scheme": "shards", "shards_per_client": 2},
            "train.batch_size": 50, "train.lr": 0.1, "train.momentum": 0.9, "train.weight_decay": 0.0,
            "train.lr_milestones": [0.5, 0.75], "train.lr_gamma": 0.1,
            "evaluate.finetune_epochs": FINETUNE_SWEEP, "evaluate.part": "full", "evaluate.lr": 0.001,
            "evaluate.momentum": 0.9, "evaluate.batch_size": 50, "evaluate.headless": True}
    cells = []
    for tau in (1, 4, 10):
        rounds = max(1, epochs_total // tau)
        cells.append(Cell(f"tau={tau}", {"train.epochs": tau, "rounds": rounds}, (
            Variant("FedAvg", {"algorithm.name": "fedavg"}),
            Variant("FedBABU", {"algorithm.name": "fedbabu"}),
            Variant("FedPer", {"algorithm.name": "fedper"}),
            # FedBABU's code runs LG-FedAvg from the trained FedAvg model, at lr 1e-3 for a quarter
            # of FedAvg's rounds (scripts/run_lg_fedavg.sh)
            Variant("LG-FedAvg", {"algorithm.name": "lg_fedavg", "train.lr": 0.001,
                                  "rounds": max(1, rounds // 4)}, start_from="FedAvg"),
            # FedBABU's FedRep: tau head epochs, then one body epoch (LocalUpdateFedRep)
            Variant("FedRep", {"algorithm.name": "fedrep", "algorithm.head_epochs": tau,
                               "algorithm.body_epochs": 1}),
        )))
    claims: list[Claim] = []
    for cell in cells:
        claims += [
            Claim("initial accuracy: FedBABU below FedAvg (random fixed head)", cell.key, "initial",
                  "FedAvg", "FedBABU"),
            Claim("personalized (tau_f=5): FedBABU above FedAvg", cell.key, "ft5", "FedBABU", "FedAvg"),
            Claim("personalized (tau_f=1): FedBABU above FedAvg (one epoch suffices)", cell.key, "ft1",
                  "FedBABU", "FedAvg"),
            Claim("head-less accuracy: FedBABU's body above FedAvg's", cell.key, "headless", "FedBABU", "FedAvg"),
        ]
        claims += [Claim(f"personalized (tau_f=5): FedBABU above {other}'s best personal model", cell.key,
                         "ft5", "FedBABU", other, worse_metric="personal_best")
                   for other in ("FedPer", "LG-FedAvg", "FedRep")]
    trend = (("FedBABU's personalized advantage over FedAvg grows with tau (tau=10 vs tau=1)",
              Claim("", "tau=1", "ft5", "FedBABU", "FedAvg"), Claim("", "tau=10", "ft5", "FedBABU", "FedAvg")),)
    return Study(
        name="fedbabu",
        paper="FedBABU (Oh, Kim & Yun, ICLR 2022)",
        setting=(f"{_data_text(base)}, 2 label shards per client, {_sampling_text(base)}; SGD lr 0.1 momentum 0.9 "
                 f"wd 0 batch 50, lr x0.1 at 50 % and 75 % of the rounds, rounds = {epochs_total} / tau (the paper: "
                 "320 / tau); fine-tuning of the full model at lr 1e-3 momentum 0.9 batch 50; accuracies are means "
                 "over clients (unweighted, as in the paper's code); LG-FedAvg starts from the FedAvg run's final "
                 "model and trains a quarter of its rounds at lr 1e-3, FedRep trains tau head epochs then one body "
                 "epoch, as in FedBABU's code"),
        base=base, cells=tuple(cells),
        columns=(_percent("initial", "initial %"), _percent("ft1", "pers. tau_f=1 %"),
                 _percent("ft5", "pers. tau_f=5 %"), _percent("headless", "head-less %"),
                 _percent("global", "global %")),
        claims=tuple(claims), trend_claims=trend,
        curve_columns=tuple(_percent(f"ft{e}", f"tau_f={e}") for e in FINETUNE_SWEEP),
        curve_title="personalized accuracy % against fine-tune epochs tau_f (mean ± std over seeds)",
    )


def _layer_expansion(size: str) -> Study:
    """Layer expansion (Vanilla / Anti) against FedAvg and FedBABU at equal rounds, with its cost."""
    if size == "full":
        # 6,000 samples cannot give 100 clients 10 each under alpha 0.1: 50 clients, min_size 5
        data = {"data.dataset": "mnist", "data.options": {"normalize": True, "train_samples": 6000,
                                                           "test_samples": 5000},
                "model.name": "cnn2", "clients": 50, "sampling.fraction": 0.1, "processes": 2,
                "evaluate.global_every": 10, "rounds": 60}
        unfreeze = [0, 20, 40]  # thirds of the rounds, as the paper's 0, 100, 200 of 300
    else:
        data = {"data.dataset": "digits", "data.options": {}, "model.name": "mlp", "model.hidden": 32,
                "clients": 10, "sampling.fraction": 0.5, "processes": 1, "evaluate.global_every": 1, "rounds": 3}
        unfreeze = [0, 1]  # mlp has two body units
    base = {**data, "data.partition": {"scheme": "dirichlet", "alpha": 0.1, "min_size": 5},
            "train.epochs": 1, "train.batch_size": 10, "train.lr": 0.005, "train.momentum": 0.0,
            "evaluate.finetune_epochs": [0, 1, 5], "evaluate.part": "full"}
    variants = (
        Variant("FedAvg", {"algorithm.name": "fedavg"}),
        Variant("FedBABU", {"algorithm.name": "fedbabu"}),
        Variant("Vanilla", {"algorithm.name": "layer_expansion_vanilla", "algorithm.unfreeze_rounds": unfreeze}),
        Variant("Anti", {"algorithm.name": "layer_expansion_anti", "algorithm.unfreeze_rounds": unfreeze}),
    )
    cell = Cell("dir0.1", {}, variants)
    claims = []
    for le in ("Vanilla", "Anti"):
        claims += [
            Claim(f"{le} uploads fewer bytes than FedAvg", cell.key, "up_mb", le, "FedAvg", lower=True),
            Claim(f"{le} trains with fewer FLOPs than FedAvg", cell.key, "gflops", le, "FedAvg", lower=True),
            Claim(f"{le} trains with fewer FLOPs than FedBABU", cell.key, "gflops", le, "FedBABU", lower=True),
            Claim(f"personalized (tau_f=5): {le} above FedAvg", cell.key, "ft5", le, "FedAvg"),
            Claim(f"personalized (tau_f=5): {le} above FedBABU", cell.key, "ft5", le, "FedBABU"),
        ]
    return Study(
        name="layer_expansion",
        paper="Sequential layer expansion (Jang & Choi, 2024)",
        setting=(f"{_data_text(base)} for every algorithm, Dirichlet alpha 0.1 over clients (at least 5 samples each), "
                 f"{_sampling_text(base)}; 1 local epoch, batch 10, SGD lr 0.005; body units unfrozen at rounds "
                 f"{unfreeze} (the paper: 0, 100, 200 of 300); the head of FedBABU and layer expansion stays at its "
                 "initialisation until the final fine-tuning (full model, lr 1e-3 momentum 0.9, 5 epochs)"),
        base=base, cells=(cell,),
        columns=(_percent("initial", "initial %"), _percent("ft5", "pers. tau_f=5 %"), _percent("global", "global %"),
                 Column("up_mb", "up MB"), Column("down_mb", "down MB"), Column("gflops", "train GFLOPs", digits=1)),
        claims=tuple(claims), per_round=True,
    )


def _fedbug(size: str) -> Study:
    """FedBug (GU ratio 0.2 / 0.4) against FedAvg on global accuracy."""
    if size == "full":
        data = {"data.dataset": "mnist", "data.options": {"normalize": True}, "model.name": "cnn2",
                "clients": 50, "processes": 2, "rounds": 20, "evaluate.global_every": 5, "train.epochs": 5,
                "data.partition": {"scheme": "dirichlet_prior", "alpha": 0.3, "samples_per_client": 150,
                                   "test_samples_per_client": 50}}
    else:
        data = {"data.dataset": "digits", "data.options": {}, "model.name": "mlp", "model.hidden": 32,
                "clients": 10, "processes": 1, "rounds": 2, "evaluate.global_every": 1, "train.epochs": 1,
                "data.partition": {"scheme": "dirichlet_prior", "alpha": 0.3}}
    base = {**data, "sampling.probability": 0.1 if size == "full" else 0.5,
            "train.batch_size": 50, "train.lr": 0.1, "train.momentum": 0.0,
            "train.weight_decay": 0.001, "train.grad_clip": 10.0, "evaluate.finetune_epochs": [0]}
    cell = Cell("dirprior0.3", {}, (
        Variant("FedAvg", {"algorithm.name": "fedavg"}),
        Variant("FedBug 0.2", {"algorithm.name": "fedbug", "algorithm.gu_ratio": 0.2}),
        Variant("FedBug 0.4", {"algorithm.name": "fedbug", "algorithm.gu_ratio": 0.4}),
    ))
    return Study(
        name="fedbug",
        paper="FedBug (Kao & Wang, 2023)",
        setting=(f"{_data_text(base)}, Dirichlet alpha 0.3 class priors per client (Hsu et al.), "
                 f"{_sampling_text(base)}; {base['train.epochs']} local epochs, SGD lr 0.1 wd 1e-3 batch 50, "
                 "gradient-norm clip 10; global accuracy of the final model on the server's test split"),
        base=base, cells=(cell,),
        columns=(_percent("global", "global %"), _percent("initial", "clients' test splits %"),
                 Column("gflops", "train GFLOPs", digits=1)),
        claims=tuple(Claim(f"global accuracy: {v} above FedAvg", cell.key, "global", v, "FedAvg")
                     for v in ("FedBug 0.2", "FedBug 0.4")),
        per_round=True,
    )


def _fedftha(size: str) -> Study:
    """FedFTHA's global model and personalization against FedAvg, FedPer and FedRep."""
    if size == "full":
        data = {"data.dataset": "mnist", "data.options": {"normalize": True, "train_samples": 6000,
                                                           "test_samples": 2500},
                "model.name": "lenet5", "clients": 20, "processes": 2, "rounds": 40, "evaluate.global_every": 5}
        tau = 5  # the paper's tau_sync = tau_head
    else:
        data = {"data.dataset": "digits", "data.options": {}, "model.name": "mlp", "model.hidden": 32,
                "clients": 10, "processes": 1, "rounds": 2, "evaluate.global_every": 1}
        tau = 1
    base = {**data, "sampling.fraction": 0.2, "data.partition": {"scheme": "shards", "shards_per_client": 2},
            "train.batch_size": 10, "train.lr": 0.01, "train.momentum": 0.5, "train.epochs": tau,
            "evaluate.finetune_epochs": [0, 1, 5], "evaluate.part": "full"}
    cell = Cell("shards2", {}, (
        Variant("FedFTHA", {"algorithm.name": "fedftha", "algorithm.tau_sync": tau, "algorithm.tau_head": tau}),
        Variant("FedAvg", {"algorithm.name": "fedavg"}),
        Variant("FedPer", {"algorithm.name": "fedper"}),
        Variant("FedRep", {"algorithm.name": "fedrep", "algorithm.head_epochs": tau, "algorithm.body_epochs": tau}),
    ))
    claims = [Claim("global accuracy: FedFTHA (FedHA's head) above FedAvg", cell.key, "global", "FedFTHA", "FedAvg")]
    claims += [Claim(f"personalized: FedFTHA's personal model above {other}'s", cell.key, "initial", "FedFTHA", other)
               for other in ("FedPer", "FedRep")]
    return Study(
        name="fedftha",
        paper="FedFTHA (fine-tuning and head aggregation)",
        setting=(f"{_data_text(base)}, 2 label shards per client, {_sampling_text(base)}; SGD lr 0.01 momentum "
                 f"0.5 batch 10; FedFTHA trains all layers for tau_sync = {tau} epochs then its head for tau_head = "
                 f"{tau}, FedAvg and FedPer {tau} epochs, FedRep {tau} head then {tau} body epochs; personal model = "
                 "each client's global body with its personal head, on its test split"),
        base=base, cells=(cell,),
        columns=(_percent("global", "global %"), _percent("initial", "personal model %"),
                 _percent("ft5", "after 5 fine-tune epochs %"), Column("up_mb", "up MB")),
        claims=tuple(claims), per_round=True,
    )


STUDIES: dict[str, Callable[[str], Study]] = {
    "fedbabu": _fedbabu,
    "layer_expansion": _layer_expansion,
    "fedbug": _fedbug,
    "fedftha": _fedftha,
}


def select(study: Study, cells: Sequence[str] = (), variants: Sequence[str] = ()) -> Study:
    """``study`` restricted to the named cells and variants (empty: all), with the claims whose
    cells and variants remain (a scaled-down run of a study)."""
    unknown = ([c for c in cells if c not in {cell.key for cell in study.cells}]
               + [v for v in variants if v not in {v.label for cell in study.cells for v in cell.variants}])
    if unknown:
        raise ValueError(f"{study.name} has no cell or variant {unknown}")
    kept = tuple(replace(cell, variants=tuple(v for v in cell.variants if not variants or v.label in variants))
                 for cell in study.cells if not cells or cell.key in cells)
    keys = {(cell.key, v.label) for cell in kept for v in cell.variants}

    def holds(claim: Claim) -> bool:
        return (claim.cell, claim.better) in keys and (claim.cell, claim.worse) in keys

    return replace(study, cells=kept, claims=tuple(c for c in study.claims if holds(c)),
                   trend_claims=tuple(t for t in study.trend_claims if holds(t[1]) and holds(t[2])))


def _rate_key(cell_key: str, lr: float) -> str:
    return f"{cell_key} lr={lr:g}"


def sweep_learning_rates(study: Study, lrs: Sequence[float]) -> Study:
    """``study`` with every cell run at each local learning rate of ``lrs`` (a cell setting
    ``train.lr``, so a variant that sets its own rate keeps it) and every claim checked per rate.
    A step size that suits one algorithm can break its baseline (FedAvg's head over-fits at lr 0.1
    with momentum 0.9 where FedBABU's fixed head cannot), so a verdict at one rate says little."""
    cells = tuple(Cell(_rate_key(cell.key, lr), {**cell.settings, "train.lr": lr}, cell.variants,
                       origin=cell.key, lr=lr)
                  for cell in study.cells for lr in lrs)
    claims = tuple(replace(claim, cell=_rate_key(claim.cell, lr)) for claim in study.claims for lr in lrs)
    trends = tuple((text, replace(small, cell=_rate_key(small.cell, lr)), replace(large, cell=_rate_key(large.cell, lr)))
                   for text, small, large in study.trend_claims for lr in lrs)
    rates = ", ".join(f"{lr:g}" for lr in lrs)
    setting = (f"{study.setting}; swept over the local learning rate (train.lr in {rates}, replacing the rate above; "
               "a variant with a rate of its own keeps it)")
    return replace(study, setting=setting, cells=cells, claims=claims, trend_claims=trends, lrs=tuple(lrs))


# ------------------------------------------------------------------------------------- running


@dataclass
class Record:
    """One run: where it is, how long it took, how it ended and what it measured."""

    study: str
    cell: str
    variant: str
    seed: int
    out: str
    command: list[str]
    wall_seconds: float
    error: str | None = None
    values: dict[str, float | None] = field(default_factory=dict)
    curve: list[dict[str, float]] = field(default_factory=list)  # per tested round
    mark: str | None = None  # why the run did not train (see :func:`mark_runs`); None when it did


def _setting(key: str, value: Any) -> str:
    """One ``key=value`` override; JSON is valid YAML, which is how fedpart parses the value."""
    return f"{key}={json.dumps(value)}"


def run_settings(study: Study, cell: Cell, variant: Variant, seed: int, data_root: Path,
                 extra: dict[str, Any]) -> dict[str, Any]:
    """Every setting of one run as dotted keys, later entries winning: study, cell, variant,
    ``--set`` (a mapping value replaces its whole section, as with ``fedpart run --set``)."""
    settings = {"name": f"{study.name}_{cell.key}_{variant.label}".replace(" ", "_"), "seed": seed,
                **study.base, **cell.settings, **variant.settings, **extra}
    if settings.get("data.dataset") != "digits":
        settings.setdefault("data.root", str(data_root.resolve()))
    return settings


def run_one(study: Study, cell: Cell, variant: Variant, seed: int, out: Path, settings: dict[str, Any],
            timeout: float) -> Record:
    """``fedpart run`` of a config holding exactly ``settings`` (every other key at its documented
    default) into the new directory ``out``, then its numbers."""
    out.parent.mkdir(parents=True, exist_ok=True)
    config_path = out.parent / f"{out.name}.yaml"
    config_path.write_text(yaml.safe_dump(apply_overrides({}, [_setting(k, v) for k, v in settings.items()]),
                                          sort_keys=False))
    command = [sys.executable, "-m", "fedpart", "run", str(config_path), "--out", str(out)]
    log_path = out.parent / f"{out.name}.log"
    code, wall = run_bounded(command, log_path, timeout, cwd=REPO)
    record = Record(study.name, cell.key, variant.label, seed, str(out), command, wall)
    if code != 0:
        record.error = failure(code, timeout, log_path)
        return record
    try:
        run = read_run(out)
        record.values, record.curve = measure(run)
    except (ReportError, KeyError, TypeError, ValueError) as error:
        record.error = f"unreadable run directory {out}: {error!r}"
    return record


def measure(run: Run) -> tuple[dict[str, float | None], list[dict[str, float]]]:
    """The numbers a study tabulates, from a finished run's ``summary.json`` and round records:
    accuracies (means over clients), totals of bytes and training FLOPs, and per tested round the
    global accuracy with the cumulative bytes and FLOPs up to that round."""
    if run.summary is None:
        raise ValueError("the run has no summary.json")
    summary = run.summary
    accuracy = summary.accuracy
    values: dict[str, float | None] = {
        "initial": accuracy.initial.mean,
        "headless": accuracy.headless.mean if accuracy.headless is not None else None,
        "global": run.final_global_accuracy(),
        "up_mb": summary.bytes.up / 1e6,
        "down_mb": summary.bytes.down / 1e6,
        "gflops": summary.compute.train_flops / 1e9,
        "seconds": summary.seconds,
    }
    for epochs, stats in accuracy.personalized.items():
        values[f"ft{epochs}"] = stats.mean
    personal = [v for v in (values["initial"], values.get("ft5")) if v is not None]
    values["personal_best"] = max(personal) if personal else None
    losses = [record.train_loss for record in run.rounds]
    values["nonfinite_loss_rounds"] = float(sum(loss is not None and not math.isfinite(loss) for loss in losses))
    curve, up, down, flops = [], 0, 0, 0.0
    for record in run.rounds:
        up, down, flops = up + record.bytes_up, down + record.bytes_down, flops + record.train_flops
        accuracy = record.global_accuracy()
        if accuracy is not None:
            curve.append({"round": record.round, "acc": accuracy, "up_mb": up / 1e6,
                          "down_mb": down / 1e6, "gflops": flops / 1e9})
    return values, curve


def run_directory(out_root: Path, study: Study, seed: int, cell: Cell, variant: Variant) -> Path:
    return out_root / study.name / f"seed{seed}" / cell.key.replace(" ", "_") / variant.label.replace(" ", "_")


def model_accuracy(record: Record) -> float | None:
    """What a run's trained model reaches: the global model's accuracy on the server's test split
    where the algorithm has one, else the clients' mean personal (initial) accuracy."""
    value = record.values.get("global")
    return record.values.get("initial") if value is None else value


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def mark_runs(study: Study, records: Sequence[Record], margin: float = CHANCE_MARGIN,
              gap: float = UNDERTRAINED_GAP) -> None:
    """Set ``mark`` on every finished run that did not train, with the reason: *diverged* (a round's
    training loss or the model's accuracy is not finite), *collapsed* (:func:`model_accuracy`
    below chance + ``margin``) or, in a learning-rate sweep, *under-trained* (more than ``gap``
    below the same variant at its best rate in the same cell and seed)."""
    chance = 1.0 / study.classes
    cells = {cell.key: cell for cell in study.cells}
    finished = [r for r in records if r.error is None]
    for record in records:
        record.mark = None
    for record in finished:
        accuracy = model_accuracy(record)
        if record.values.get("nonfinite_loss_rounds") or (accuracy is not None and not math.isfinite(accuracy)):
            record.mark = "diverged: a non-finite training loss or accuracy"
        elif accuracy is not None and accuracy < chance + margin:
            record.mark = f"collapsed: model accuracy {accuracy * 100:.1f} % (chance {chance * 100:.0f} %)"
    for record in finished:
        cell = cells.get(record.cell)
        accuracy = model_accuracy(record)
        if record.mark is not None or cell is None or cell.origin is None or not _finite(accuracy):
            continue
        peers = [r for r in finished if r.variant == record.variant and r.seed == record.seed
                 and r.cell in cells and cells[r.cell].origin == cell.origin and _finite(model_accuracy(r))]
        best = max(peers, key=model_accuracy)
        if model_accuracy(best) - accuracy > gap:
            record.mark = (f"under-trained: model accuracy {accuracy * 100:.1f} % against "
                           f"{model_accuracy(best) * 100:.1f} % at lr {cells[best.cell].lr:g}")


def collect_study(study: Study, seeds: Sequence[int], out_root: Path) -> list[Record]:
    """The records of the run directories an earlier invocation left under ``out_root``, nothing
    run (tables of a study stopped between seeds). A run's wall seconds are then the server's run
    time from its ``summary.json``; a missing or unfinished run is a failed row."""
    records = []
    for seed in seeds:
        for cell in study.cells:
            for variant in cell.variants:
                out = run_directory(out_root, study, seed, cell, variant)
                record = Record(study.name, cell.key, variant.label, seed, str(out), [], 0.0)
                try:
                    run = read_run(out)
                    record.values, record.curve = measure(run)
                    record.wall_seconds = float(run.summary.seconds)
                except (ReportError, KeyError, TypeError, ValueError) as error:
                    record.error = f"no finished run in {out}: {error}"
                records.append(record)
    return records


def run_study(study: Study, seeds: Sequence[int], out_root: Path, data_root: Path, extra: dict[str, Any],
              timeout: float) -> list[Record]:
    """Every seed x cell x variant, one run after another (seed-major, so that an interrupted
    study still has whole seeds)."""
    records: list[Record] = []
    for seed in seeds:
        for cell in study.cells:
            done: dict[str, Record] = {}
            for variant in cell.variants:
                settings = run_settings(study, cell, variant, seed, data_root, extra)
                out = run_directory(out_root, study, seed, cell, variant)
                if variant.start_from is not None:
                    origin = done.get(variant.start_from)
                    if origin is None or origin.error is not None:
                        record = Record(study.name, cell.key, variant.label, seed, str(out), [], 0.0,
                                        error=f"needs the {variant.start_from} run, which failed")
                        records.append(record)
                        print(f"{study.name} seed {seed} {cell.key} {variant.label}: skipped, {record.error}", flush=True)
                        continue
                    last = read_run(origin.out).summary.rounds
                    settings["model.init_checkpoint"] = str(Path(origin.out) / "checkpoints" / f"round_{last:04d}.safetensors")
                record = run_one(study, cell, variant, seed, out, settings, timeout)
                done[variant.label] = record
                records.append(record)
                status = "FAILED: " + record.error if record.error else "ok"
                print(f"{study.name} seed {seed} {cell.key} {variant.label}: {record.wall_seconds:.1f} s, {status}",
                      flush=True)
    return records


# ------------------------------------------------------------------------------------- tables


def _values(records: Sequence[Record], cell: str, variant: str, key: str, marked: bool = True) -> dict[int, float]:
    """Seed -> value of ``key`` for one row (runs that failed or lack the value left out, and
    marked runs too unless ``marked``)."""
    return {r.seed: r.values[key] for r in records
            if r.cell == cell and r.variant == variant and r.error is None and r.values.get(key) is not None
            and (marked or r.mark is None)}


def _mean_std(values: Sequence[float], scale: float, digits: int) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def _row_cells(records: Sequence[Record], cell: Cell, variant: Variant, columns: Sequence[Column]) -> list[str]:
    rows = [r for r in records if r.cell == cell.key and r.variant == variant.label]
    ok = [r for r in rows if r.error is None]
    status = f"{len(ok)}/{len(rows)}" if rows else "0/0"
    marked = sum(r.mark is not None for r in ok)
    if marked:
        status += f" ({marked} marked)"
    walls = [r.wall_seconds for r in ok]
    return ([cell.key, variant.label, status]
            + [_mean_std(list(_values(records, cell.key, variant.label, c.key).values()), c.scale, c.digits)
               for c in columns]
            + [f"{statistics.fmean(walls):.0f}" if walls else "-"])


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def results_table(study: Study, records: Sequence[Record]) -> str:
    """One row per cell and variant: mean ± std over seeds of every column, runs ok, wall s/run."""
    header = ["cell", "variant", "runs ok"] + [c.title for c in study.columns] + ["wall s/run"]
    return _markdown(header, [_row_cells(records, cell, v, study.columns) for cell in study.cells for v in cell.variants])


def curve_table(study: Study, records: Sequence[Record]) -> str:
    header = ["cell", "variant", "runs ok"] + [c.title for c in study.curve_columns] + ["wall s/run"]
    return _markdown(header, [_row_cells(records, cell, v, study.curve_columns)
                              for cell in study.cells for v in cell.variants])


def per_round_table(study: Study, records: Sequence[Record]) -> str:
    """Global accuracy at every tested round against cumulative MB (up + down) and training
    GFLOPs up to that round, means over seeds: the communication and compute efficiency curves."""
    header = ["cell", "variant", "round", "global acc %", "cumulative MB up+down", "cumulative train GFLOPs"]
    rows = []
    for cell in study.cells:
        for variant in cell.variants:
            curves = [r.curve for r in records if r.cell == cell.key and r.variant == variant.label and not r.error]
            rounds = sorted({p["round"] for c in curves for p in c})
            for number in rounds:
                points = [p for c in curves for p in c if p["round"] == number]
                rows.append([cell.key, variant.label, str(number),
                             _mean_std([p["acc"] for p in points], 100.0, 2),
                             f"{statistics.fmean(p['up_mb'] + p['down_mb'] for p in points):.1f}",
                             f"{statistics.fmean(p['gflops'] for p in points):.1f}"])
    return _markdown(header, rows)


@dataclass
class Verdict:
    text: str
    cell: str
    measured: str
    verdict: str


def _differences(records: Sequence[Record], claim: Claim) -> dict[int, float]:
    """Seed -> (better - worse) in the claimed direction (positive = the claim holds in that seed),
    over the seeds where neither run failed or is marked."""
    better = _values(records, claim.cell, claim.better, claim.metric, marked=False)
    worse = _values(records, claim.worse_cell or claim.cell, claim.worse, claim.worse_metric or claim.metric,
                    marked=False)
    sign = -1.0 if claim.lower else 1.0
    return {s: sign * (better[s] - worse[s]) for s in sorted(set(better) & set(worse))}


def _left_out(records: Sequence[Record], claim: Claim) -> list[str]:
    """The marked runs of a claim's two rows, as ``FedAvg seed 1 under-trained``."""
    rows = {(claim.cell, claim.better), (claim.worse_cell or claim.cell, claim.worse)}
    return [f"{r.variant} seed {r.seed} {r.mark.split(':')[0]}" for r in records
            if (r.cell, r.variant) in rows and r.error is None and r.mark is not None]


def _verdict(differences: Sequence[float]) -> str:
    if not differences:
        return "no data"
    mean = statistics.fmean(differences)
    if mean <= 0:
        return "not reproduced"
    return "reproduced" if all(d > 0 for d in differences) else "inconclusive"


def _scale(metric: str) -> tuple[float, str]:
    """Accuracies (fractions) are shown in percentage points, other quantities as measured."""
    if metric in ("initial", "headless", "global", "personal_best") or metric.startswith("ft"):
        return 100.0, " points"
    return 1.0, ""


def _claim_verdict(claim: Claim, records: Sequence[Record], cell_text: str) -> Verdict:
    differences = _differences(records, claim)
    left_out = _left_out(records, claim)
    scale, unit = _scale(claim.metric)
    values = ", ".join(f"{d * scale:+.2f}" for d in differences.values())
    measured = (f"{claim.better} - {claim.worse}" if not claim.lower else f"{claim.worse} - {claim.better}")
    measured += f" = {statistics.fmean(differences.values()) * scale:+.2f}{unit} (seeds: {values})" \
        if differences else ": no data"
    if left_out:
        measured += "; left out: " + ", ".join(left_out)
    verdict = _verdict(list(differences.values()))
    if not differences and left_out:
        verdict = "no verdict (a run did not train)"
    return Verdict(claim.text, cell_text, measured, verdict)


def best_rates(study: Study, records: Sequence[Record]) -> dict[tuple[str, str], float]:
    """(unswept cell, variant) -> the swept rate at which the variant's :func:`model_accuracy`,
    averaged over the seeds that finished, is highest."""
    means: dict[tuple[str, str], tuple[float, float]] = {}
    for cell in study.cells:
        if cell.origin is None or cell.lr is None:
            continue
        for variant in cell.variants:
            accuracies = [model_accuracy(r) for r in records
                          if r.cell == cell.key and r.variant == variant.label and r.error is None]
            accuracies = [a for a in accuracies if _finite(a)]
            key = (cell.origin, variant.label)
            if accuracies and (key not in means or statistics.fmean(accuracies) > means[key][1]):
                means[key] = (cell.lr, statistics.fmean(accuracies))
    return {key: lr for key, (lr, _) in means.items()}


def verdicts(study: Study, records: Sequence[Record]) -> list[Verdict]:
    """One verdict per claim (per rate in a sweep, then each claim with both variants at their own
    best rates), then the trend claims."""
    out = [_claim_verdict(claim, records, claim.cell) for claim in study.claims]
    if study.lrs:
        origins = {cell.key: cell.origin for cell in study.cells}
        best = best_rates(study, records)
        first = _rate_key("", study.lrs[0])
        for claim in study.claims:
            origin = origins.get(claim.cell)
            if origin is None or not claim.cell.endswith(first):
                continue  # one best-rate verdict per claim: from the claim at the first rate
            better, worse = best.get((origin, claim.better)), best.get((origin, claim.worse))
            if better is None or worse is None:
                continue
            paired = replace(claim, cell=_rate_key(origin, better), worse_cell=_rate_key(origin, worse))
            cell_text = f"{origin}, best lr ({claim.better} {better:g}, {claim.worse} {worse:g})"
            out.append(_claim_verdict(paired, records, cell_text))
    for text, small, large in study.trend_claims:
        low, high = _differences(records, small), _differences(records, large)
        growth = {s: high[s] - low[s] for s in sorted(set(low) & set(high))}
        scale, unit = _scale(large.metric)
        values = ", ".join(f"{d * scale:+.2f}" for d in growth.values())
        measured = (f"gap at {large.cell} - gap at {small.cell} = {statistics.fmean(growth.values()) * scale:+.2f}"
                    f"{unit} (seeds: {values})") if growth else "no data"
        left_out = _left_out(records, small) + _left_out(records, large)
        if left_out:
            measured += "; left out: " + ", ".join(left_out)
        verdict = _verdict(list(growth.values()))
        if not growth and left_out:
            verdict = "no verdict (a run did not train)"
        out.append(Verdict(text, f"{small.cell} → {large.cell}", measured, verdict))
    return out


def verdict_table(found: Sequence[Verdict]) -> str:
    return _markdown(["claim", "cell", "measured (paired by seed)", "verdict"],
                     [[v.text, v.cell, v.measured, f"**{v.verdict}**"] for v in found])


def study_markdown(study: Study, records: Sequence[Record], seeds: Sequence[int], size: str, wall: str,
                   command: str) -> str:
    """The study's section: command, setting, tables and verdicts; ``wall`` says how long it took."""
    runs_ok = sum(r.error is None for r in records)
    parts = [f"### {study.paper}", "", f"`{command}`", "",
             f"Setting ({size}): {study.setting}. Seeds {', '.join(map(str, seeds))}; {runs_ok}/{len(records)} runs "
             f"completed; {wall}.", "",
             results_table(study, records), ""]
    if study.curve_columns:
        parts += [study.curve_title + ":", "", curve_table(study, records), ""]
    if study.per_round:
        parts += ["Global accuracy per tested round against cumulative bytes and training FLOPs (means over seeds):",
                  "", per_round_table(study, records), ""]
    parts += [verdict_table(verdicts(study, records)), ""]
    marked = [r for r in records if r.error is None and r.mark]
    if marked:
        parts += [f"Runs that did not train (left out of every verdict; chance + {CHANCE_MARGIN * 100:.0f} points "
                  f"is collapsed, more than {UNDERTRAINED_GAP * 100:.0f} points below the variant's best rate is "
                  "under-trained):", ""]
        parts += [f"- {r.cell} {r.variant} seed {r.seed}: {r.mark}" for r in marked] + [""]
    failed = [r for r in records if r.error]
    if failed:
        parts += ["Failed runs:", ""] + [f"- {r.cell} {r.variant} seed {r.seed}: {r.error.splitlines()[0]}"
                                         for r in failed] + [""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------- main


def _parse_set(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected KEY=VALUE")
    return key.strip(), yaml.safe_load(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="*", default=list(STUDIES), help=f"any of {', '.join(STUDIES)} (default: all)")
    parser.add_argument("--size", choices=SIZES, default="full", help="full (MNIST) or tiny (digits, a round or two)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--cells", default="", help="comma-separated cells of the studies to run (default: all)")
    parser.add_argument("--variants", default="", help="comma-separated variants to run (default: all)")
    parser.add_argument("--lrs", default="",
                        help="comma-separated local learning rates: every cell at each (train.lr), verdicts per rate")
    parser.add_argument("--set", dest="sets", action="append", type=_parse_set, default=[], metavar="KEY=VALUE",
                        help="override a setting of every run (e.g. --set model.name=cnn2)")
    parser.add_argument("--data-root", type=Path, default=default_data_root(), help="holds MNIST/raw/*.gz")
    parser.add_argument("--out-root", type=Path, help="run directories go here (default: a new temporary folder)")
    parser.add_argument("--json", type=Path, help="write every run's numbers and the tables to this file")
    parser.add_argument("--markdown", type=Path, help="write the studies' sections (docs/results.md) to this file")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: tabulate the run directories an earlier invocation left under --out-root")
    args = parser.parse_args(argv)
    if args.collect and args.out_root is None:
        parser.error("--collect needs the --out-root of the earlier invocation")
    unknown = [s for s in args.studies if s not in STUDIES]
    if unknown:
        parser.error(f"unknown studies {unknown}; known: {', '.join(STUDIES)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: comma-separated integers")
    if not args.seeds:
        parser.error("--seeds: give at least one seed")
    args.cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        args.lrs = [float(lr) for lr in args.lrs.split(",") if lr.strip()]
    except ValueError:
        parser.error(f"--lrs {args.lrs!r}: comma-separated numbers")
    if not all(lr > 0 and math.isfinite(lr) for lr in args.lrs) or len(set(args.lrs)) != len(args.lrs):
        parser.error(f"--lrs {args.lrs}: distinct positive rates")
    if args.lrs and any(key == "train.lr" for key, _ in args.sets):
        parser.error("--lrs and --set train.lr both set the learning rate: give one")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_root = args.out_root or Path(tempfile.mkdtemp(prefix="fedpart-reproduce-"))
    extra = dict(args.sets)
    print(f"run directories under {out_root}", flush=True)
    sections, dump, failed = [], {"size": args.size, "seeds": args.seeds, "studies": {}}, False
    for name in args.studies:
        try:
            study = select(STUDIES[name](args.size), args.cells, args.variants)
        except ValueError as error:
            print(f"reproduce.py: {error}", file=sys.stderr)
            return 2
        if args.lrs:
            study = sweep_learning_rates(study, args.lrs)
        started = time.perf_counter()
        if args.collect:
            records = collect_study(study, args.seeds, out_root)
            wall = sum(r.wall_seconds for r in records)
            wall_text = f"the runs' server times add up to {wall / 60:.1f} min (tabulated from their run directories)"
        else:
            records = run_study(study, args.seeds, out_root, args.data_root, extra, args.timeout)
            wall = time.perf_counter() - started
            wall_text = f"study wall time {wall / 60:.1f} min"
        mark_runs(study, records)
        command = f"python benchmarks/reproduce.py {name} --size {args.size} --seeds {','.join(map(str, args.seeds))}"
        command += f" --cells {','.join(args.cells)}" if args.cells else ""
        command += f" --variants {','.join(args.variants)}" if args.variants else ""
        command += f" --lrs {','.join(f'{lr:g}' for lr in args.lrs)}" if args.lrs else ""
        command += "".join(f" --set {k}={json.dumps(v)}" for k, v in extra.items())
        section = study_markdown(study, records, args.seeds, args.size, wall_text, command)
        print("\n" + section, flush=True)
        sections.append(section)
        found = verdicts(study, records)
        dump["studies"][name] = {"paper": study.paper, "setting": study.setting, "wall_seconds": wall,
                                 "records": [asdict(r) for r in records],
                                 "verdicts": [asdict(v) for v in found], "markdown": section}
        failed = failed or any(r.error for r in records)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(sections))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dump, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
