"""Run directories read into plain records: the resolved config, the round records of
``metrics.jsonl`` and, for a finished run, ``summary.json`` (docs/output.md). Nothing here imports
torch; a report reads run directories on any machine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedpart.common.process.records import ByteCounts, RoundRecord, RunSummary


class ReportError(ValueError):
    """A run directory or an option the report cannot use (the message says which and why)."""


SEED_SOURCES = ("partition", "init", "sampling", "training")
# What summary.json's status and note say about how the server exited (docs/operating-a-run.md, "Exit codes"), for
# summaries that do not record the code itself.
SIGNAL_EXIT_CODES = {"interrupted": 130, "terminated": 143}
GAVE_UP_EXIT_CODE, ERROR_EXIT_CODE, FAILURES_EXIT_CODE = 4, 1, 3
NO_SUMMARY = "interrupted"  # a run directory without summary.json: the server was killed


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    label: str
    config: dict[str, Any]
    rounds: list[RoundRecord]
    summary: RunSummary | None  # summary.json of a completed run (None: the run did not complete)
    notes: list[str] = field(default_factory=list)  # what the report cannot show for this run, and why
    status: str | None = None  # summary.json's status (completed, interrupted, failed); None without one
    summary_file: RunSummary | None = None  # summary.json as written, whatever its status
    group: str = ""  # the label of the runs that differ from this one only in their seeds

    @property
    def complete(self) -> bool:
        """The run finished: its final evaluation and ``summary.json`` were written."""
        return self.summary is not None

    @property
    def state(self) -> str:
        """How the run ended: ``completed``, ``completed with failures`` (failures listed, clients
        without a final evaluation, or a non-zero recorded exit code), ``interrupted`` (also: no
        summary.json) or ``failed``."""
        if self.status == "completed" and self.failed:
            return "completed with failures"
        return self.status or NO_SUMMARY

    @property
    def failures(self) -> list[str]:
        """summary.json's failures (results refused or lost, clients that left, ...)."""
        return list(self.summary_file.failures or []) if self.summary_file is not None else []

    @property
    def missing_evaluations(self) -> int:
        """Clients of a completed run without a final evaluation (the server exits 3 for them)."""
        if self.summary is None:
            return 0
        return sum(1 for client in self.summary.per_client or [] if client.test_samples is None)

    @property
    def unlisted_missing_evaluations(self) -> int:
        """Missing evaluations that summary.json's failures do not list already: a server that
        records its exit code lists them there itself, with its rounds that lacked results."""
        return 0 if self.lists_its_shortfalls else self.missing_evaluations

    @property
    def lists_its_shortfalls(self) -> bool:
        """summary.json's failures name the rounds whose clients sent no result and the clients
        without a final evaluation (a server that records its exit code writes them)."""
        return self.summary_file is not None and isinstance(self.summary_file.exit_code, int)

    @property
    def failed(self) -> bool:
        """Anything went wrong: the run did not complete, or it completed with failures."""
        recorded = self.summary_file.exit_code if self.summary_file is not None else None
        return not self.complete or bool(self.failures) or bool(self.missing_evaluations) or bool(recorded)

    def exit_code_and_source(self) -> tuple[int | None, str]:
        """The server's exit code and where it comes from: ``recorded`` in summary.json,
        ``derived`` from its status, note and failures, or ``unknown`` (no summary.json)."""
        summary = self.summary_file
        if summary is None:
            return None, "unknown"
        if isinstance(summary.exit_code, int):
            return summary.exit_code, "recorded"
        note = summary.note or ""
        if self.status == "completed":
            return (FAILURES_EXIT_CODE if self.failures or self.missing_evaluations else 0), "derived"
        if self.status == "failed":
            return (GAVE_UP_EXIT_CODE if note.startswith("gave up") else ERROR_EXIT_CODE), "derived"
        for reason, code in SIGNAL_EXIT_CODES.items():
            if note.startswith(reason):
                return code, "derived"
        return None, "unknown"

    @property
    def exit_code(self) -> int | None:
        return self.exit_code_and_source()[0]

    @property
    def algorithm(self) -> str:
        if self.summary is not None:
            return self.summary.algorithm
        return self.config.get("algorithm", {}).get("name", "?")

    @property
    def configured_rounds(self) -> int | None:
        return self.summary.rounds if self.summary is not None else self.config.get("rounds")

    @property
    def seeds(self) -> dict[str, int | None]:
        """The seed of each source of randomness: summary.json's ``seeds``, else the config's
        ``seeds`` section, where a source left unset takes the run's ``seed``."""
        recorded = self.summary_file.seeds if self.summary_file is not None else None
        if isinstance(recorded, dict):
            return {source: recorded.get(source) for source in SEED_SOURCES}
        configured, seed = self.config.get("seeds") or {}, self.config.get("seed")
        return {source: seed if configured.get(source) is None else configured[source] for source in SEED_SOURCES}

    def short_rounds(self) -> list[tuple[int, int, int]]:
        """``(round, completed, sampled)`` of the rounds that folded fewer clients than sampled."""
        return [(r.round, len(r.completed), len(r.sampled)) for r in self.rounds if len(r.completed) < len(r.sampled)]

    def global_accuracy(self) -> list[tuple[int, float]]:
        """``(round, accuracy)`` of the global model on the server's test set, for the rounds
        where it was tested (``evaluate.global_every``)."""
        return [(r.round, r.global_accuracy()) for r in self.rounds if r.global_accuracy() is not None]

    def final_global_accuracy(self) -> float | None:
        """The global model's accuracy after the last round (summary.json)."""
        return self.summary.global_accuracy() if self.summary is not None else None

    @property
    def virtual_clock(self) -> bool:
        """Every round record has the virtual clock's time (``heterogeneity.clock: virtual``)."""
        return bool(self.rounds) and all(r.virtual_seconds is not None for r in self.rounds)

    def wall_seconds(self) -> dict[int, float]:
        """The server's wall time of the rounds so far, at the end of each round."""
        total, out = 0.0, {}
        for record in self.rounds:
            total += record.seconds
            out[record.round] = total
        return out

    def clock_seconds(self) -> dict[int, float]:
        """The run's time at the end of each round: the virtual clock's where it ran one, else
        the server's wall time (:meth:`wall_seconds`)."""
        if self.virtual_clock:
            return {r.round: r.virtual_seconds for r in self.rounds}
        return self.wall_seconds()

    def staleness(self) -> dict[int, int]:
        """How many folded results had each staleness (buffered engine; empty for a synchronous run)."""
        counts: dict[int, int] = {}
        for record in self.rounds:
            for staleness, count in (record.buffered.staleness if record.buffered is not None else {}).items():
                counts[int(staleness)] = counts.get(int(staleness), 0) + count
        return dict(sorted(counts.items()))

    def has_client_entries(self) -> bool:
        """Every round record has the per-client bytes and compute seconds the link model needs."""
        return bool(self.rounds) and all(r.clients is not None for r in self.rounds)

    def has_logical_bytes(self) -> bool:
        """Every round record has logical bytes (each sampled client as its own device)."""
        return bool(self.rounds) and all(r.logical is not None for r in self.rounds)


def round_bytes(record: RoundRecord, direction: str, logical: bool) -> int:
    """A round's bytes in ``direction`` (down / up): logical where asked and recorded, else physical."""
    if logical and record.logical is not None:
        return record.logical.bytes_in(direction)
    return record.bytes_in(direction)


def round_bytes_by_part(record: RoundRecord, logical: bool) -> dict[str, ByteCounts]:
    """A round's bytes by model part: logical where asked and recorded, else physical."""
    if logical and record.logical is not None:
        return record.logical.by_part
    return record.bytes_by_part


def _read_rounds(path: Path) -> list[RoundRecord]:
    """The round records of ``metrics.jsonl``; a last line cut short by a crash is dropped, any
    other unreadable line is an error naming file and line."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rounds = []
    for number, line in enumerate(lines, start=1):
        try:
            record = RoundRecord.from_json(json.loads(line))
        except ValueError as error:
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
        summary = RunSummary.from_json(json.loads(summary_path.read_text())) if summary_path.is_file() else None
    except (yaml.YAMLError, ValueError) as error:
        raise ReportError(f"{path}: unreadable run file: {error}") from error
    # a run that ended early writes what it knew, marked; older runs' summaries carry no status
    status = (summary.status or "completed") if summary is not None else None
    run = Run(path=path, label=label or path.name, config=config or {}, rounds=_read_rounds(metrics_path),
              summary=summary if status == "completed" else None, status=status, summary_file=summary)
    run.notes = _missing(run)
    return run


def _missing(run: Run) -> list[str]:
    """Sentences naming what the report cannot show for ``run`` and why."""
    notes = []
    if not run.complete:
        why = ("no summary.json (the server was stopped before it could write one)" if run.status is None
               else f"summary.json marks it {run.status}"
               + (f" ({run.summary_file.note})" if run.summary_file.note else ""))
        notes.append(f"{run.state}: {why}; the run stopped after round {len(run.rounds)} of "
                     f"{run.configured_rounds or '?'}; the final evaluation (initial, personalized and global "
                     "accuracy, wall time) is missing")
    short = run.short_rounds()
    if short:
        listed = ", ".join(f"{number} ({done} of {sampled})" for number, done, sampled in short)
        notes.append(f"{len(short)} round{'s' if len(short) > 1 else ''} folded fewer clients than sampled "
                     f"(marked x on the per-round curves): {listed}")
    if run.rounds and not run.has_logical_bytes():
        notes.append("metrics.jsonl has no logical bytes (recorded since fedpart counts each sampled client as its "
                     "own device): bytes are physical, what crossed each connection, where a process hosting "
                     "several clients downloads a changed tensor once")
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


def _group_key(run: Run) -> str:
    """Runs with equal keys differ at most in their seeds: one group of the report."""
    config = {key: value for key, value in run.config.items() if key not in ("seed", "seeds")}
    return json.dumps([run.algorithm, config], sort_keys=True, default=str)


def _seed_text(run: Run, varying: Sequence[str]) -> str:
    """What tells ``run`` from the others of its group: its seed, or each seed that varies."""
    values = {run.seeds[source] for source in varying}
    if len(values) == 1:
        return f"seed {values.pop()}"
    return "seeds " + ", ".join(f"{source} {run.seeds[source]}" for source in varying)


def group_runs(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs by :attr:`Run.group`, in the order of their first run."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    return groups


def _label(runs: list[Run], labelled: bool) -> None:
    """Give every run its group and, unless ``labelled``, its label: runs whose configs differ only
    in their seeds, each with other seeds, form one group named after their algorithm (by
    directory where two groups share an algorithm), each run named by its seeds."""
    by_config: dict[str, list[Run]] = {}
    for run in runs:
        by_config.setdefault(_group_key(run), []).append(run)
    members: dict[str, list[Run]] = {}
    for key, group in by_config.items():
        if len({tuple(run.seeds.values()) for run in group}) == len(group):
            members[key] = group
        else:  # runs with the same seeds are not seeds of one experiment: each its own group
            members.update({f"{key} {run.path}": [run] for run in group})
    algorithms = [group[0].algorithm for group in members.values()]
    for group in members.values():
        first = group[0]
        if labelled and len(group) == 1:
            name = first.label
        elif algorithms.count(first.algorithm) == 1:
            name = first.algorithm
        else:
            name = f"{first.algorithm} ({first.path.name if len(group) == 1 else first.path.parent.name})"
        varying = [s for s in SEED_SOURCES if len({run.seeds[s] for run in group}) > 1]
        for run in group:
            run.group = name
            if not labelled:
                run.label = name if len(group) == 1 else (f"{name} {_seed_text(run, varying)}" if varying
                                                          else f"{name} ({run.path.name})")
    if len({r.label for r in runs}) != len(runs):
        for run in runs:
            run.label = str(run.path)
    if len({r.group for r in runs}) != len(members):
        for group in members.values():
            for run in group:
                run.group = str(group[0].path) if len(group) == 1 else f"{group[0].algorithm} ({group[0].path.parent})"


def read_runs(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> list[Run]:
    """The runs in ``paths``, grouped (runs that differ only in their seeds are one group) and
    labelled by ``labels``, or else by algorithm and seed (by directory where two groups share an
    algorithm)."""
    if labels is not None and len(labels) != len(paths):
        raise ReportError(f"{len(labels)} labels for {len(paths)} run directories")
    if len({Path(p).resolve() for p in paths}) != len(paths):
        raise ReportError("a run directory is named twice")
    runs = [read_run(p, label) for p, label in zip(paths, labels or [None] * len(paths))]
    _label(runs, labelled=labels is not None)
    return runs
