"""``fedpart export RUN_DIR --out DIR``: take the clients' personalized models away.

Every client fine-tunes the final model on its own data and keeps the result in its process's
state dir (``fedpart.client.store``). This command collects those files for one run: from
``RUN_DIR/state/process_*`` (what ``fedpart run`` lays out) or from the ``--state-dir`` of each
client process, and writes into ``--out``

- ``client_<id>.safetensors`` per client: the model's tensors, with the metadata
  :func:`fedpart.api.load_model` rebuilds it from in the header (see ``fedpart.api.exported``);
- ``manifest.json``: per client its file, the state dir (process) that hosted it and its
  metadata; the run's id, status and accuracy summary; the clients that left no model.

``RUN_DIR`` is the server's run directory (``config.yaml``, ``summary.json``,
``server_state/state.json`` name the model, the accuracies and the run id). Nothing here imports
torch until the command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpart.common.process.records import ClientResult, RunSummary, Section, read_summary

if TYPE_CHECKING:
    from fedpart.common.config.run_config import RunConfig

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
SERVER_STATE_FILE = Path("server_state") / "state.json"
PROCESS_STATE_GLOB = "state/process_*"


class ExportError(ValueError):
    """The export cannot be made (the message says what to give instead)."""


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``export`` command to ``fedpart``'s subcommands."""
    parser = subparsers.add_parser(
        "export", help="write each client's personalized model, with its metadata, and a manifest",
        description="Collect the personalized models of a finished run into --out: one safetensors file "
                    "per client (load it with fedpart.api.load_model) and manifest.json.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (of fedpart run or fedpart server)")
    parser.add_argument("--out", required=True, help="directory to write into (new or empty)")
    parser.add_argument("--state-dir", action="append", default=None, metavar="DIR",
                        help="a client process's --state-dir (repeat for each process; default: "
                             "RUN_DIR/state/process_*, where fedpart run keeps them)")
    parser.set_defaults(handler=run_export)
    return parser


def run_export(args: argparse.Namespace) -> int:
    """Export the run ``args.run_dir``'s personalized models into ``args.out``; returns 0.
    Raises :class:`ExportError` when there is nothing to export or ``--out`` is not empty."""
    from fedpart.common.config.run_config import load_config

    run_dir, out = Path(args.run_dir), Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory; give a new one")
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml")
    summary_path = run_dir / "summary.json"
    summary = read_summary(summary_path) if summary_path.is_file() else RunSummary()
    state_dirs = _state_dirs(run_dir, args.state_dir)
    run_id = _run_id(run_dir, state_dirs)
    found = _personalized_models(state_dirs, run_id)
    if not found:
        searched = ", ".join(str(d) for d in state_dirs) or f"{run_dir / PROCESS_STATE_GLOB} (none there)"
        raise ExportError(f"no personalized client model of run {run_id} in {searched}; give each client "
                          "process's state dir with --state-dir (the run must have reached its final evaluation)")
    entries = _write_models(config, summary, run_id, found, run_dir, out)
    missing = [c for c in range(config.clients) if c not in found]
    manifest = {
        "format": MANIFEST_FORMAT,
        "run_id": run_id,
        "run_dir": str(run_dir.resolve()),
        "run": _run_basics(config, summary),
        "clients": entries,
        "clients_without_model": missing,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    note = f"; no model from client(s) {missing}" if missing else ""
    print(f"exported {len(entries)} personalized model(s) of run {run_id} to {out} ({MANIFEST}){note}", flush=True)
    return 0


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _state_dirs(run_dir: Path, given: list[str] | None) -> list[Path]:
    """The client processes' state dirs: those given, else ``fedpart run``'s, by process index."""
    if given:
        missing = [d for d in given if not Path(d).is_dir()]
        if missing:
            raise ExportError(f"--state-dir {', '.join(missing)}: no such directory")
        return [Path(d) for d in given]

    def index(path: Path) -> tuple[int, str]:
        suffix = path.name.rpartition("_")[2]
        return (int(suffix) if suffix.isdigit() else -1, path.name)

    return sorted((p for p in run_dir.glob(PROCESS_STATE_GLOB) if p.is_dir()), key=index)


def _run_id(run_dir: Path, state_dirs: list[Path]) -> str:
    """The run's id, from the server's state; else the one run every state dir served last."""
    from fedpart.client.store import ClientStore

    server_state = _read_json(run_dir / SERVER_STATE_FILE)
    if server_state.get("run_id"):
        return str(server_state["run_id"])
    served = {ClientStore.latest_run(d) for d in state_dirs} - {""}
    if len(served) != 1:
        raise ExportError(f"{run_dir / SERVER_STATE_FILE} is missing and the state dirs served "
                          f"{sorted(served) or 'no run'}: cannot tell which run to export")
    return served.pop()


def _personalized_models(state_dirs: list[Path], run_id: str) -> dict[int, Path]:
    """Each client's personalized model file; a client found in several state dirs (its process
    moved) keeps the newest file, the one its last evaluation wrote."""
    from fedpart.client.store import ClientStore

    found: dict[int, Path] = {}
    for state_dir in state_dirs:
        for client, path in ClientStore(state_dir, run_id).personalized_models().items():
            if client not in found or path.stat().st_mtime > found[client].stat().st_mtime:
                found[client] = path
    return dict(sorted(found.items()))


def _write_models(config: RunConfig, summary: RunSummary, run_id: str, found: dict[int, Path], run_dir: Path,
                  out: Path) -> list[dict[str, Any]]:
    """Write one exported model per client; returns the manifest's client entries."""
    from fedpart.api.exported import EXPORT_FORMAT, write_exported_model
    from fedpart.common.process.checkpoint import load_tensors
    from fedpart.common.config.experiment import dataset_dims

    input_shape, num_classes = dataset_dims(config)
    per_client = {entry.id: entry for entry in summary.per_client or []}
    metric = summary.accuracy.metric if summary.accuracy is not None else None
    evaluate = config.evaluate
    common = {
        "format": EXPORT_FORMAT,
        "run_id": run_id,
        "run_name": config.name,
        "algorithm": {"name": config.algorithm.name, "options": dict(config.algorithm.options)},
        "model": {"name": config.model.name, "options": dict(config.model.options)},
        "num_classes": num_classes,
        "input_shape": list(input_shape),
        "data": {"dataset": config.data.dataset, "options": dict(config.data.options),
                 "partition": {"scheme": config.data.partition.scheme,
                               "options": dict(config.data.partition.options)},
                 "partition_seed": config.partition_seed, "clients": config.clients},
        "finetune_epochs": max(evaluate.finetune_epochs, default=0),
        "finetune": {"part": evaluate.part, "lr": evaluate.lr, "momentum": evaluate.momentum,
                     "batch_size": evaluate.batch_size},
    }
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for client, source in found.items():
        metadata = {**common, "client_id": client, **_client_results(per_client.get(client), metric)}
        file_name = f"client_{client}.safetensors"
        write_exported_model(out / file_name, load_tensors(source), metadata)
        process_dir = source.parents[2]
        entries.append({"client_id": client, "file": file_name, "process": _label(process_dir, run_dir),
                        "source": str(source.resolve()), "metadata": metadata})
    return entries


def _client_results(entry: ClientResult | None, metric: str | None) -> dict[str, Any]:
    """The client's reported metrics from summary.json's ``per_client`` (empty if it has none)."""
    if entry is None or entry.initial is None:
        return {}
    return {"accuracy": {"metric": metric, "initial": entry.initial, "personalized": entry.personalized},
            "train_samples": entry.train_samples, "test_samples": entry.test_samples}


def _label(process_dir: Path, run_dir: Path) -> str:
    """A state dir as the manifest names it: relative to the run dir when inside it."""
    try:
        return str(process_dir.resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return str(process_dir.resolve())


def _run_basics(config: RunConfig, summary: RunSummary) -> dict[str, Any]:
    """The run's name, status and accuracy summary (from summary.json where it exists)."""
    basics = {"name": config.name, "algorithm": config.algorithm.name, "model": config.model.name,
              "dataset": config.data.dataset, "clients": config.clients, "rounds": config.rounds}
    recorded = {"status": summary.status, "rounds_completed": summary.rounds_completed, "seeds": summary.seeds,
                "parameters": summary.parameters, "accuracy": summary.accuracy}
    basics.update({key: value.to_json() if isinstance(value, Section) else value
                   for key, value in recorded.items() if value is not None})
    return basics
