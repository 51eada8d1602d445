"""Run directories read into plain records: the resolved config, the round records of
``metrics.jsonl`` and, for a finished run, ``summary.json`` (README "Output"). Nothing here imports
torch; a report reads run directories on any machine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ReportError(ValueError):
    """A run directory or an option the report cannot use (the message says which and why)."""


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    label: str
    config: dict[str, Any]
    rounds: list[dict[str, Any]]
    summary: dict[str, Any] | None  # summary.json of a completed run (None: the run did not complete)
    notes: list[str] = field(default_factory=list)  # what the report cannot show for this run, and why
    status: str | None = None  # summary.json's status (completed, interrupted, failed); None without one

    @property
    def complete(self) -> bool:
        """The run finished: its final evaluation and ``summary.json`` were written."""
        return self.summary is not None

    @property
    def algorithm(self) -> str:
        if self.summary is not None:
            return self.summary["algorithm"]
        return self.config.get("algorithm", {}).get("name", "?")

    @property
    def configured_rounds(self) -> int | None:
        return self.summary["rounds"] if self.summary is not None else self.config.get("rounds")

    def global_accuracy(self) -> list[tuple[int, float]]:
        """``(round, accuracy)`` of the global model on the server's test set, for the rounds
        where it was tested (``evaluate.global_every``)."""
        return [(r["round"], r["global"]["acc"]) for r in self.rounds if "acc" in r.get("global", {})]

    def final_global_accuracy(self) -> float | None:
        """The global model's accuracy after the last round (summary.json)."""
        if self.summary is None:
            return None
        return self.summary["accuracy"].get("global", {}).get("acc")

    def has_client_entries(self) -> bool:
        """Every round record has the per-client bytes and compute seconds the link model needs."""
        return bool(self.rounds) and all("clients" in r for r in self.rounds)


def _read_rounds(path: Path) -> list[dict[str, Any]]:
    """The round records of ``metrics.jsonl``; a last line cut short by a crash is dropped, any
    other unreadable line is an error naming file and line."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rounds = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record["round"], int):
                raise ValueError("no round number")
        except (ValueError, KeyError) as error:
            if number == len(lines):
                break  # the line being written when the server stopped
            raise ReportError(f"{path}:{number}: not a round record ({error})") from error
        rounds.append(record)
    return rounds


def read_run(path: str | Path, label: str | None = None) -> Run:
    """The run in directory ``path``: refuses a directory that is not a run directory."""
    path = Path(path)
    config_path, metrics_path, summary_path = path / "config.yaml", path / "metrics.jsonl", path / "summary.json"
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory")
    if not config_path.is_file() and not metrics_path.is_file():
        raise ReportError(f"{path}: not a run directory (neither config.yaml nor metrics.jsonl)")
    try:
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    except (yaml.YAMLError, ValueError) as error:
        raise ReportError(f"{path}: unreadable run file: {error}") from error
    # a run that ended early writes what it knew, marked; older runs' summaries carry no status
    status = summary.get("status", "completed") if summary is not None else None
    run = Run(path=path, label=label or path.name, config=config or {}, rounds=_read_rounds(metrics_path),
              summary=summary if status == "completed" else None, status=status)
    run.notes = _missing(run)
    return run


def _missing(run: Run) -> list[str]:
    """Sentences naming what the report cannot show for ``run`` and why."""
    notes = []
    if not run.complete:
        why = "no summary.json" if run.status is None else f"summary.json marks it {run.status}"
        notes.append(f"incomplete: {why}, the run stopped after round {len(run.rounds)} of "
                     f"{run.configured_rounds or '?'}; the final evaluation (initial, personalized and global "
                     "accuracy, wall time) is missing")
    if not run.rounds:
        notes.append("no rounds in metrics.jsonl: nothing per round to plot")
    evaluate = run.config.get("evaluate", {})
    if run.rounds and not run.global_accuracy():
        if not evaluate.get("global_every", 0):
            notes.append("no accuracy per round: set evaluate.global_every (e.g. --set evaluate.global_every=1) "
                         "to test the global model every k rounds")
        elif evaluate.get("global_test", True) is False:
            notes.append("no accuracy per round: evaluate.global_test is off (the server holds no test set)")
        elif run.config.get("data", {}).get("num_classes") == 0:
            notes.append("no accuracy per round: a regression run has losses, not accuracies")
        else:
            notes.append(f"no accuracy per round: {run.algorithm} keeps parts of the model on the clients, so the "
                         "server has no complete global model to test; see the personalization figures")
    if run.rounds and not run.has_client_entries():
        notes.append("metrics.jsonl has no per-client bytes and compute seconds (written before they were "
                     "recorded): time on a link cannot be modelled")
    return notes


def read_runs(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> list[Run]:
    """The runs in ``paths``, labelled by ``labels`` or else by algorithm (by directory where two
    runs share an algorithm)."""
    if labels is not None and len(labels) != len(paths):
        raise ReportError(f"{len(labels)} labels for {len(paths)} run directories")
    if len({Path(p).resolve() for p in paths}) != len(paths):
        raise ReportError("a run directory is named twice")
    runs = [read_run(p, label) for p, label in zip(paths, labels or [None] * len(paths))]
    if labels is None:
        algorithms = [r.algorithm for r in runs]
        for run in runs:
            run.label = run.algorithm if algorithms.count(run.algorithm) == 1 else f"{run.algorithm} ({run.path.name})"
        if len({r.label for r in runs}) != len(runs):
            for run in runs:
                run.label = str(run.path)
    return runs
