"""Differential check of fedpart against an independent implementation, PFLlib.

PFLlib (Zhang et al., "PFLlib: A Beginner-Friendly and Comprehensive Personalized Federated
Learning Library", JMLR 2025; github.com/TsingZ0/PFLlib) implements FedAvg (McMahan et al. 2017),
FedBABU (Oh et al., ICLR 2022), FedPer (Arivazhagan et al. 2019), FedRep (Collins et al., ICML
2021) and LG-FedAvg (Liang et al. 2020) with the same model as fedpart's ``cnn2`` (its
``FedAvgCNN``, 582,026 parameters on MNIST). For each algorithm and seed this script:

1. runs the algorithm in fedpart: a real ``fedpart run`` of ``configs/mnist_cnn2.yaml`` (MNIST, 20
   clients with 2 label shards each, 10 clients a round, plain SGD without momentum), the seed
   varying the initial model, the clients sampled each round and the batch order, the partition
   fixed by ``--partition-seed``;
2. rebuilds that run's partition in this process (fedpart's own ``make_partition`` and model
   inputs, from the run's ``config.yaml``) and writes every client's arrays into PFLlib's data
   layout (``dataset/<name>/{train,test}/<client>.npz``) in a temporary folder;
3. builds PFLlib's server and clients for the same algorithm in this process, loads fedpart's
   initial model (``checkpoints/round_0000``) into PFLlib's model, and replays fedpart's rounds:
   each round the clients fedpart sampled (``metrics.jsonl``) train with PFLlib's code and PFLlib's
   server aggregates them (PFLlib's own client selection is bypassed; its batch order is PFLlib's,
   seeded with the same seed);
4. tests both systems' final models on the same per-client test splits and prints them side by
   side, with the difference in points.

PFLlib is imported from the checkout given by ``--pfllib`` (its ``system`` folder); nothing of it
is copied here. Of PFLlib's modules only the servers and clients of the five algorithms are
loaded, never its ``main.py``: that one imports torchvision, which cannot import against every
torch build, and none of the loaded modules does. Where ``h5py`` is not installed, a placeholder
module stands in for it inside this process only: PFLlib's ``serverbase`` imports it for
``save_results``, which the harness never calls; any attribute of the placeholder raises.

Protocol differences the table keeps apart (see :data:`NOTES`):

- PFLlib's ``train()`` runs ``global_rounds + 1`` rounds and evaluates at the start of each; the
  replay runs exactly fedpart's rounds and tests after the last aggregation.
- FedBABU: PFLlib fine-tunes after its extra round, every client from the model it holds then
  (the clients trained in that round from their own local models). The *matched* row fine-tunes
  every client from the final global model (fedpart's protocol) with PFLlib's ``fine_tune``;
  the *PFLlib protocol* row adds PFLlib's extra round, drawn by its own client selection.
- Accuracies are means over clients, unweighted (fedpart's ``summary.json``); PFLlib's own
  printout weights by test samples (the weighted means are in the JSON file).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "mnist_cnn2.yaml"
CLIENTS = 20
SHARDS_PER_CLIENT = 2
FRACTION = 0.5
DATASET_NAME = "fedpart_crosscheck"


@dataclass(frozen=True)
class PfllibAlgorithm:
    """Where PFLlib keeps an algorithm's server class and what differs in its protocol."""

    name: str
    module: str
    server_class: str
    has_global_model: bool
    finetunes: bool = False


# fedpart algorithm name -> PFLlib's.
ALGORITHMS: dict[str, PfllibAlgorithm] = {
    "fedavg": PfllibAlgorithm("FedAvg", "flcore.servers.serveravg", "FedAvg", has_global_model=True),
    "fedbabu": PfllibAlgorithm("FedBABU", "flcore.servers.serverbabu", "FedBABU", has_global_model=True,
                               finetunes=True),
    "fedper": PfllibAlgorithm("FedPer", "flcore.servers.serverper", "FedPer", has_global_model=False),
    "fedrep": PfllibAlgorithm("FedRep", "flcore.servers.serverrep", "FedRep", has_global_model=False),
    "lg_fedavg": PfllibAlgorithm("LG-FedAvg", "flcore.servers.serverlg", "LG_FedAvg", has_global_model=False),
}

NOTES: dict[str, str] = {
    "fedavg": ("same protocol; PFLlib evaluates the global model sent to every client, "
               "fedpart the global model on each client's split and on the server's test set"),
    "fedbabu": ("head fixed at its initial values in both; fine-tuning (1 epoch, whole model, "
                "lr = the training lr, no momentum): 'matched' from the final global model as fedpart "
                "does, 'PFLlib protocol' after PFLlib's extra round (its own client draw), every client "
                "from the model it holds then, the ones trained in that round from their local models"),
    "fedper": "personal head, shared body; no fine-tuning: the clients' models after the last round",
    "fedrep": ("head epochs (1) then body epochs (train epochs) per round in both (PFLlib "
               "plocal_epochs / local_epochs, fedpart head_epochs / body_epochs)"),
    "lg_fedavg": ("PFLlib's LG-FedAvg shares the head and keeps the body local, as fedpart's lg_fedavg "
                  "does; personal bodies start from the same initial model"),
}

# fedpart cnn2 state-dict prefixes -> PFLlib's FedAvgCNN inside BaseHeadSplit (``base`` = FedAvgCNN
# with ``fc`` replaced by Identity, ``head`` = the former ``fc``).
CNN2_TO_PFLLIB: tuple[tuple[str, str], ...] = (
    ("body.conv1.0.", "base.conv1.0."),
    ("body.conv2.0.", "base.conv2.0."),
    ("body.fc1.1.", "base.fc1.0."),
    ("head.", "head."),
)


# ------------------------------------------------------------------------------- pure pieces


def _renamed(state: dict[str, torch.Tensor], pairs: Sequence[tuple[str, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        match = next((new + key[len(old):] for old, new in pairs if key.startswith(old)), None)
        if match is None:
            raise KeyError(f"no mapping for state-dict key {key!r}")
        out[match] = value
    return out


def to_pfllib_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fedpart ``cnn2`` state dict -> PFLlib ``BaseHeadSplit(FedAvgCNN)`` state dict (same tensors)."""
    return _renamed(state, CNN2_TO_PFLLIB)


def to_fedpart_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_pfllib_state`."""
    return _renamed(state, [(new, old) for old, new in CNN2_TO_PFLLIB])


@dataclass
class ClientArrays:
    """One client's model inputs and labels, as fedpart's clients feed them to the model."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def client_arrays(config: Any) -> list[ClientArrays]:
    """Every client's split of a fedpart run (its ``RunConfig``), rebuilt as fedpart's client
    processes build it (:func:`fedpart.client.local_data.load_client_data`)."""
    from fedpart.common.data.datasets import load_dataset
    from fedpart.common.data.partition import make_partition

    data = config.data
    dataset = load_dataset(data.dataset, data.root, **data.options)
    splits = make_partition(dataset.y_train, dataset.y_test, config.clients, data.partition.scheme,
                            config.partition_seed, num_classes=dataset.num_classes, **data.partition.options)
    return [ClientArrays(x_train=dataset.features(dataset.x_train[s.train]).numpy(),
                         y_train=dataset.targets(dataset.y_train[s.train]).numpy(),
                         x_test=dataset.features(dataset.x_test[s.test]).numpy(),
                         y_test=dataset.targets(dataset.y_test[s.test]).numpy()) for s in splits]


def write_pfllib_dataset(clients: Sequence[ClientArrays], dataset_dir: Path) -> None:
    """PFLlib's per-client files: ``train/<id>.npz`` and ``test/<id>.npz``, each holding ``data`` =
    ``{"x": inputs, "y": labels}`` (what ``utils.data_utils.read_data`` loads)."""
    for split in ("train", "test"):
        (dataset_dir / split).mkdir(parents=True, exist_ok=True)
    for client_id, arrays in enumerate(clients):
        for split, x, y in (("train", arrays.x_train, arrays.y_train), ("test", arrays.x_test, arrays.y_test)):
            with open(dataset_dir / split / f"{client_id}.npz", "wb") as file:
                np.savez(file, data={"x": x, "y": y})


def read_pfllib_dataset(dataset_dir: Path, client_id: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """One client's ``(x, y)`` from PFLlib's layout, read as PFLlib reads it."""
    with open(dataset_dir / split / f"{client_id}.npz", "rb") as file:
        data = np.load(file, allow_pickle=True)["data"].tolist()
    return data["x"], data["y"]


def read_schedule(run_dir: Path) -> list[list[int]]:
    """The clients fedpart sampled in each round, in round order (``metrics.jsonl``). A round that
    folded fewer clients than it sampled is refused: replaying it would not be the same run."""
    from fedpart.common.process.records import read_rounds

    schedule = []
    for record in read_rounds(run_dir / "metrics.jsonl"):
        if sorted(record.completed) != sorted(record.sampled):
            raise ValueError(f"{run_dir}: round {record.round} folded {record.completed} "
                             f"of the sampled {record.sampled}")
        schedule.append([int(c) for c in record.sampled])
    return schedule


def replay_round(server: Any, client_ids: Sequence[int]) -> None:
    """One PFLlib round (the body of its servers' ``train()`` loop, without the evaluation) with
    the given clients instead of PFLlib's own draw."""
    server.selected_clients = [server.clients[i] for i in client_ids]
    server.current_num_join_clients = len(client_ids)
    server.send_models()
    for client in server.selected_clients:
        client.train()
    server.receive_models()
    server.aggregate_parameters()


def replay(server: Any, schedule: Sequence[Sequence[int]]) -> None:
    """Every round of ``schedule`` in order (:func:`replay_round`)."""
    for client_ids in schedule:
        replay_round(server, client_ids)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 1000) -> float:
    """Top-1 accuracy of ``model`` on inputs ``x`` and labels ``y``."""
    model.eval()
    correct = 0
    for start in range(0, len(y), batch_size):
        logits = model(torch.from_numpy(x[start:start + batch_size]))
        correct += int((logits.argmax(dim=1) == torch.from_numpy(y[start:start + batch_size])).sum())
    return correct / len(y)


def client_stats(values: Sequence[float], weights: Sequence[int]) -> dict[str, float]:
    """Mean over clients (unweighted), std, and the sample-weighted mean, as fedpart's summary."""
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values),
            "weighted_mean": sum(v * w for v, w in zip(values, weights)) / sum(weights)}


# --------------------------------------------------------------------------------- fedpart side


@dataclass(frozen=True)
class Setting:
    """What both systems share."""

    rounds: int
    epochs: int
    batch_size: int
    lr: float
    partition_seed: int
    processes: int
    data_root: Path


def fedpart_overrides(algorithm: str, seed: int, setting: Setting) -> list[str]:
    """``--set`` values of the fedpart run of ``algorithm`` with ``seed``."""
    values: dict[str, Any] = {
        "name": f"crosscheck_{algorithm}_s{seed}",
        "seed": seed,
        "seeds.partition": setting.partition_seed,
        "rounds": setting.rounds,
        "clients": CLIENTS,
        "processes": setting.processes,
        "sampling.fraction": FRACTION,
        "data.dataset": "mnist",
        "data.root": str(setting.data_root.resolve()),
        "data.partition.scheme": "shards",
        "data.partition.shards_per_client": SHARDS_PER_CLIENT,
        "model.name": "cnn2",
        "algorithm.name": algorithm,
        "train.epochs": setting.epochs,
        "train.batch_size": setting.batch_size,
        "train.lr": setting.lr,
        "train.momentum": 0.0,
        "evaluate.finetune_epochs": [1] if ALGORITHMS[algorithm].finetunes else [],
        "evaluate.part": "full",
        "evaluate.lr": setting.lr,
        "evaluate.momentum": 0.0,
        "evaluate.batch_size": setting.batch_size,
        "checkpoint.every": 0,
    }
    if algorithm == "fedrep":
        values.update({"algorithm.head_epochs": 1, "algorithm.body_epochs": setting.epochs})
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def run_fedpart(algorithm: str, seed: int, setting: Setting, run_dir: Path, timeout: float) -> None:
    """``fedpart run`` into ``run_dir`` (kept when it already holds a completed run)."""
    from fedpart.common.process.records import read_summary
    from fedpart.deploy.launcher import failure, run_bounded

    if (run_dir / "summary.json").is_file() and read_summary(run_dir / "summary.json").status == "completed":
        return
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.parent / f"{run_dir.name}.log"
    command = [sys.executable, "-m", "fedpart", "run", str(CONFIG), "--out", str(run_dir), "--overwrite"]
    command += [a for o in fedpart_overrides(algorithm, seed, setting) for a in ("--set", o)]
    code, _ = run_bounded(command, log_path, timeout, cwd=REPO)
    if code != 0:
        raise RuntimeError(f"fedpart run {algorithm} seed {seed}: {failure(code, timeout, log_path)}")


def fedpart_results(run_dir: Path) -> dict[str, Any]:
    """The accuracies of a finished fedpart run, from its ``summary.json``."""
    from fedpart.common.process.records import read_summary

    summary = read_summary(run_dir / "summary.json")
    accuracy = summary.accuracy
    personalized = accuracy.personalized.get("1")
    return {  # the stats as PFLlib's side writes them (mean, std, ...)
        "global": summary.global_accuracy(),
        "initial": accuracy.initial.to_json(),
        "personalized_1": personalized.to_json() if personalized is not None else None,
        "initial_per_client": [c.initial for c in summary.per_client],
        "personalized_1_per_client": [c.personalized.get("1") for c in summary.per_client],
    }


# ---------------------------------------------------------------------------------- PFLlib side


class _Placeholder(types.ModuleType):
    """A module that stands in for an import PFLlib makes and the harness never uses."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{self.__name__}.{name}: a placeholder of pfllib_crosscheck, not the real module")


def install_placeholders() -> None:
    """A placeholder ``h5py`` where it is not installed (this process only)."""
    try:
        importlib.import_module("h5py")
    except ImportError:
        sys.modules["h5py"] = _Placeholder("h5py")


def pfllib_module(pfllib_dir: Path, name: str) -> types.ModuleType:
    """A module of PFLlib's ``system`` folder (``flcore...``, ``utils...``), imported from the checkout."""
    system = str((pfllib_dir / "system").resolve())
    if system not in sys.path:
        sys.path.insert(0, system)
    install_placeholders()
    return importlib.import_module(name)


def pfllib_model(pfllib_dir: Path, initial_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """PFLlib's ``BaseHeadSplit(FedAvgCNN)`` for MNIST (as its ``main.py`` builds it for these
    algorithms) holding fedpart's initial model."""
    models = pfllib_module(pfllib_dir, "flcore.trainmodel.models")
    model = models.FedAvgCNN(in_features=1, num_classes=10, dim=1024)
    head = copy.deepcopy(model.fc)
    model.fc = torch.nn.Identity()
    split = models.BaseHeadSplit(model, head)
    split.load_state_dict(to_pfllib_state(initial_state))
    return split


def pfllib_args(algorithm: str, model: torch.nn.Module, setting: Setting) -> argparse.Namespace:
    """The attributes PFLlib's servers and clients read from its ``main.py`` arguments; defaults
    are PFLlib's, except the shared setting and no learning-rate decay, slow or dropped clients."""
    return argparse.Namespace(
        device="cpu", dataset=DATASET_NAME, num_classes=10, model=model, algorithm=ALGORITHMS[algorithm].name,
        global_rounds=setting.rounds, local_epochs=setting.epochs, batch_size=setting.batch_size,
        local_learning_rate=setting.lr, learning_rate_decay=False, learning_rate_decay_gamma=0.99,
        num_clients=CLIENTS, join_ratio=FRACTION, random_join_ratio=False, few_shot=0,
        time_select=False, goal="crosscheck", time_threthold=10000, save_folder_name="items", top_cnt=100,
        auto_break=False, eval_gap=1, client_drop_rate=0.0, train_slow_rate=0.0, send_slow_rate=0.0,
        dlg_eval=False, dlg_gap=100, batch_num_per_client=2, num_new_clients=0, fine_tuning_epoch_new=0,
        fine_tuning_epochs=1, plocal_epochs=1,
    )


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """PFLlib reads ``../dataset/<name>/`` relative to the working directory."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def seed_everything(seed: int) -> None:
    """PFLlib's draws: torch (batch order), numpy (its client selection), random (upload order)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_clients(models: Sequence[torch.nn.Module], clients: Sequence[ClientArrays]) -> list[float]:
    return [accuracy(m, c.x_test, c.y_test) for m, c in zip(models, clients)]


def run_pfllib(algorithm: str, seed: int, setting: Setting, pfllib_dir: Path, run_dir: Path,
               clients: Sequence[ClientArrays], global_test: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """PFLlib's ``algorithm`` replaying the fedpart run in ``run_dir``; its accuracies."""
    from fedpart.common.process.checkpoint import load_tensors

    schedule = read_schedule(run_dir)
    initial = load_tensors(run_dir / "checkpoints" / "round_0000.safetensors")
    spec = ALGORITHMS[algorithm]
    weights = [len(c.y_test) for c in clients]
    with tempfile.TemporaryDirectory(prefix="pfllib-crosscheck-") as scratch:
        write_pfllib_dataset(clients, Path(scratch) / "dataset" / DATASET_NAME)
        (Path(scratch) / "system").mkdir()
        with working_directory(Path(scratch) / "system"):
            server_class = getattr(pfllib_module(pfllib_dir, spec.module), spec.server_class)
            args = pfllib_args(algorithm, pfllib_model(pfllib_dir, initial), setting)
            server = server_class(args, 0)
            seed_everything(seed)  # after the clients: PFLlib's Client.__init__ calls torch.manual_seed(0)
            started = time.perf_counter()
            replay(server, schedule)
            server.send_models()  # what PFLlib does before its evaluation: shared parts to every client
            per_client = test_clients([c.model for c in server.clients], clients)
            result: dict[str, Any] = {
                "rounds": len(schedule),
                "initial": client_stats(per_client, weights),
                "initial_per_client": per_client,
                "global": accuracy(server.clients[0].model, *global_test) if spec.has_global_model else None,
            }
            if spec.finetunes:
                tuned = [copy.deepcopy(c) for c in server.clients]
                for client in tuned:
                    client.fine_tune()
                matched = test_clients([c.model for c in tuned], clients)
                result["personalized_1"] = client_stats(matched, weights)
                result["personalized_1_per_client"] = matched
                replay_round(server, [c.id for c in server.select_clients()])  # PFLlib's extra round
                for client in server.clients:
                    client.fine_tune()
                native = test_clients([c.model for c in server.clients], clients)
                result["pfllib_protocol_1"] = client_stats(native, weights)
                result["pfllib_protocol_1_per_client"] = native
            result["seconds"] = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------- table


@dataclass
class Row:
    """One measure of one algorithm and seed in both systems (fractions)."""

    algorithm: str
    seed: int
    measure: str
    fedpart: float | None
    pfllib: float | None
    largest_client_difference: float | None = None

    @property
    def difference(self) -> float | None:
        return None if self.fedpart is None or self.pfllib is None else self.pfllib - self.fedpart


@dataclass
class Pair:
    """Both systems' results for one algorithm and seed."""

    algorithm: str
    seed: int
    fedpart: dict[str, Any]
    pfllib: dict[str, Any]
    rows: list[Row] = field(default_factory=list)


def _largest(a: Sequence[float | None] | None, b: Sequence[float | None] | None) -> float | None:
    if not a or not b or any(v is None for v in list(a) + list(b)):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


def rows_of(algorithm: str, seed: int, fedpart: dict[str, Any], pfllib: dict[str, Any]) -> list[Row]:
    """The measures of one pair that both systems have."""
    rows = []
    if ALGORITHMS[algorithm].has_global_model:
        rows.append(Row(algorithm, seed, "global model, MNIST test set", fedpart["global"], pfllib["global"]))
    rows.append(Row(algorithm, seed, "clients' models, own test splits (mean)", fedpart["initial"]["mean"],
                    pfllib["initial"]["mean"],
                    _largest(fedpart["initial_per_client"], pfllib["initial_per_client"])))
    if ALGORITHMS[algorithm].finetunes:
        personalized = fedpart["personalized_1"]["mean"]
        rows.append(Row(algorithm, seed, "fine-tuned 1 epoch, matched (mean)", personalized,
                        pfllib["personalized_1"]["mean"],
                        _largest(fedpart["personalized_1_per_client"], pfllib["personalized_1_per_client"])))
        rows.append(Row(algorithm, seed, "fine-tuned 1 epoch, PFLlib protocol (mean)", personalized,
                        pfllib["pfllib_protocol_1"]["mean"]))
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _points(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f}"


def table(rows: Sequence[Row]) -> str:
    """Markdown table of every row, then the protocol note of each algorithm in it."""
    lines = ["| algorithm | seed | measure | fedpart % | PFLlib % | PFLlib - fedpart (points) | largest client gap (points) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        gap = "-" if r.largest_client_difference is None else f"{100 * r.largest_client_difference:.2f}"
        lines.append(f"| {r.algorithm} ({ALGORITHMS[r.algorithm].name}) | {r.seed} | {r.measure} | "
                     f"{_percent(r.fedpart)} | {_percent(r.pfllib)} | {_points(r.difference)} | {gap} |")
    lines.append("")
    for algorithm in dict.fromkeys(r.algorithm for r in rows):
        lines.append(f"- {algorithm}: {NOTES[algorithm]}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- main


def _names(text: str, parser: argparse.ArgumentParser) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown or not names:
        parser.error(f"--algorithms: unknown {unknown}; known: {', '.join(ALGORITHMS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pfllib", type=Path, required=True, help="a PFLlib checkout (holds system/flcore)")
    parser.add_argument("--out", type=Path, required=True,
                        help="fedpart runs, PFLlib results and the table go here (finished pairs are reused)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (init, sampling, batches)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated fedpart names")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=4, help="local epochs (FedRep: body epochs)")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, no momentum")
    parser.add_argument("--partition-seed", type=int, default=0, help="seeds.partition of every run")
    parser.add_argument("--processes", type=int, default=2, help="fedpart client processes")
    parser.add_argument("--data-root", type=Path, default=REPO.parent / "shared" / "data",
                        help="holds MNIST/raw/*.gz")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one fedpart run may take")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the PFLlib replay (fedpart's client processes get theirs from fedpart run)")
    args = parser.parse_args(argv)
    args.algorithms = _names(args.algorithms, parser)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not (args.pfllib / "system" / "flcore" / "servers").is_dir():
        parser.error(f"--pfllib {args.pfllib}: no system/flcore/servers folder")
    return args


def _global_test(config: Any) -> tuple[np.ndarray, np.ndarray]:
    from fedpart.common.data.datasets import load_dataset

    dataset = load_dataset(config.data.dataset, config.data.root, **config.data.options)
    return dataset.features(dataset.x_test).numpy(), dataset.targets(dataset.y_test).numpy()


def cross_check(algorithm: str, seed: int, args: argparse.Namespace, setting: Setting,
                data_cache: dict[str, Any], log: Callable[[str], None]) -> Pair:
    """One algorithm and seed in both systems (each side reused from ``--out`` when there)."""
    from fedpart.common.config.run_config import load_config

    run_dir = args.out / "fedpart" / f"{algorithm}_s{seed}"
    started = time.perf_counter()
    run_fedpart(algorithm, seed, setting, run_dir, args.timeout)
    log(f"{algorithm} seed {seed}: fedpart run done ({time.perf_counter() - started:.0f} s)")
    fedpart = fedpart_results(run_dir)
    result_path = args.out / "pfllib" / f"{algorithm}_s{seed}.json"
    if result_path.is_file():
        pfllib = json.loads(result_path.read_text())
    else:
        config = load_config(run_dir / "config.yaml")
        key = json.dumps([config.data.dataset, str(config.data.root), config.partition_seed, config.clients])
        if key not in data_cache:
            data_cache[key] = (client_arrays(config), _global_test(config))
        clients, global_test = data_cache[key]
        pfllib = run_pfllib(algorithm, seed, setting, args.pfllib, run_dir, clients, global_test)
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps(pfllib, indent=1))
        log(f"{algorithm} seed {seed}: PFLlib replay done ({pfllib['seconds']:.0f} s)")
    return Pair(algorithm, seed, fedpart, pfllib, rows_of(algorithm, seed, fedpart, pfllib))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setting = Setting(rounds=args.rounds, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                      partition_seed=args.partition_seed, processes=args.processes, data_root=args.data_root)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    print(f"setting: MNIST cnn2, {CLIENTS} clients x {SHARDS_PER_CLIENT} shards (partition seed "
          f"{args.partition_seed}), {int(CLIENTS * FRACTION)} a round, {args.rounds} rounds, {args.epochs} local "
          f"epochs, batch {args.batch_size}, SGD lr {args.lr} no momentum; seeds {args.seeds}", flush=True)
    data_cache: dict[str, Any] = {}
    pairs: list[Pair] = []
    failures: list[str] = []
    for seed in args.seeds:
        for algorithm in args.algorithms:
            try:
                pairs.append(cross_check(algorithm, seed, args, setting, data_cache, lambda m: print(m, flush=True)))
            except (RuntimeError, ValueError, OSError, KeyError) as error:
                failures.append(f"{algorithm} seed {seed}: {error}")
                print(f"FAILED {failures[-1]}", flush=True)
    rendered = table([r for p in pairs for r in p.rows])
    print()
    print(rendered)
    (args.out / "table.md").write_text(rendered + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "setting": {**asdict(setting), "data_root": str(setting.data_root)},
        "pairs": [asdict(p) for p in pairs], "failures": failures}, indent=1))
    for line in failures:
        print(f"FAILED {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
