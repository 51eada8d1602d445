"""The comparison table and the per-round table.

The comparison: one row per run, its numbers taken from ``summary.json`` (accuracy, bytes per
round, wall time, status, failures) and ``metrics.jsonl`` (compute per round, rounds that folded
fewer clients than sampled; the run's own clock, virtual where it ran one, and its time to the
target accuracy, the clients' utilization, staleness and bytes per folded update), plus the
modelled time on a link when one is given; and one row per
group of runs that differ only in their seeds, with the mean, standard deviation and count of
each number. Written as CSV (full precision, for scripts) and Markdown (rounded). The per-round
table (``rounds.csv``): one row per run and round, from ``metrics.jsonl``."""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fedpart.common.process.records import DIRECTIONS, ModelMetrics
from fedpart.report.link import (Link, cumulative_seconds, round_times, time_to_accuracy,
                                        uses_logical_bytes)
from fedpart.report.runs import SEED_SOURCES, Run, group_runs, round_bytes


@dataclass(frozen=True)
class Column:
    key: str                              # CSV header
    title: str                            # Markdown / HTML header
    show: Callable[[Any], str]            # rounded text for Markdown / HTML


def _text(value: Any) -> str:
    return str(value)


def _percent(value: float) -> str:
    return f"{100 * value:.2f}"


def _bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"


def _flops(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g}"


IDENTITY_COLUMNS = [
    Column("row", "row", _text),  # run: one run; group: the runs of one group, mean (and _std, _n)
    Column("group", "group", _text),
    Column("run", "run", _text),
    Column("algorithm", "algorithm", _text),
    *(Column(f"seed_{source}", f"{source} seed", _text) for source in SEED_SOURCES),
    Column("status", "status", _text),
    Column("exit_code", "exit code", _text),
    Column("exit_code_source", "exit code from", _text),
    Column("failures", "failures", _text),
    Column("failure_list", "failure list", _text),
    Column("short_rounds", "short rounds", _text),
    Column("short_round_list", "short rounds (completed of sampled)", _text),
    Column("rounds", "rounds", _text),
    Column("bytes_counted", "bytes", _text),
    Column("engine", "engine", _text),
    Column("clock", "clock", _text),
]
# Numbers a group averages: the run rows hold the run's value, the group rows the mean over the
# group's runs that have one, with KEY_std (sample standard deviation, two runs or more) and KEY_n.
NUMBER_COLUMNS = [
    Column("initial_acc", "initial acc %", _percent),
    Column("personalized_acc", "personalized acc %", _percent),
    Column("global_acc", "global acc %", _percent),
    Column("bytes_down_per_round", "down / round", _bytes),
    Column("bytes_up_per_round", "up / round", _bytes),
    Column("physical_bytes_down_per_round", "physical down / round", _bytes),
    Column("physical_bytes_up_per_round", "physical up / round", _bytes),
    Column("client_compute_seconds_per_round", "client compute / round", _seconds),
    Column("train_flops_per_round", "train FLOPs / round", _flops),
    Column("wall_seconds", "wall time", _seconds),
    Column("clock_seconds", "run time", _seconds),
    Column("clock_time_to_target", "time to target", _seconds),
    Column("utilization", "utilization %", _percent),
    Column("mean_staleness", "mean staleness", lambda value: f"{value:.2f}"),
    Column("bytes_per_update", "bytes / update", _bytes),
]
FINETUNE_COLUMN = Column("finetune_epochs", "fine-tune epochs", _text)
LINK_COLUMNS = [
    Column("link_seconds_per_round", "link time / round", _seconds),
    Column("link_seconds_total", "link time, all rounds", _seconds),
    Column("link_time_to_target", "link time to target", _seconds),
]
# The columns of the readable table (Markdown, HTML): the CSV has them all.
SHOWN_KEYS = ("run", "status", "exit_code", "failures", "short_rounds", "rounds", "initial_acc",
              "personalized_acc", "finetune_epochs", "global_acc", "bytes_down_per_round", "bytes_up_per_round",
              "physical_bytes_down_per_round", "physical_bytes_up_per_round", "client_compute_seconds_per_round",
              "train_flops_per_round", "wall_seconds", "engine", "clock", "clock_seconds", "clock_time_to_target",
              "utilization", "mean_staleness", "bytes_per_update", *(c.key for c in LINK_COLUMNS))


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _per_round_mean(run: Run, direction: str, logical: bool) -> float | None:
    """Bytes per training round in ``direction``: summary.json's mean where the run completed,
    else the mean of its round records."""
    summary = run.summary
    if summary is not None:
        if not logical:
            return summary.bytes.per_round_mean.bytes_in(direction)
        if summary.bytes.logical is not None:
            return summary.bytes.logical.per_round_mean.bytes_in(direction)
    return _mean([round_bytes(r, direction, logical) for r in run.rounds])


def _clock_numbers(run: Run, target: float | None) -> dict[str, Any]:
    """The run on its own clock (virtual where it ran one, else the server's wall time): its
    engine, run time, time to ``target`` accuracy, the share of the clients' time they trained
    (virtual clock), the mean staleness of its folded results (buffered engine) and its logical
    bytes per folded update."""
    rounds = run.rounds
    clock = run.clock_seconds()
    staleness = run.staleness()
    folded = sum(len(r.completed) for r in rounds)
    clients = run.config.get("clients")
    row: dict[str, Any] = {
        "engine": run.config.get("server", {}).get("engine", "sync"),
        "clock": "virtual" if run.virtual_clock else "wall",
        "clock_seconds": clock[rounds[-1].round] if rounds else None,
        "clock_time_to_target": None, "utilization": None,
        "mean_staleness": (sum(s * n for s, n in staleness.items()) / sum(staleness.values())) if staleness else None,
        "bytes_per_update": (sum(round_bytes(r, d, True) for r in rounds for d in DIRECTIONS) / folded
                             if folded and run.has_logical_bytes() else None),
    }
    if target is not None and rounds:
        row["clock_time_to_target"] = time_to_accuracy(rounds, [clock[r.round] for r in rounds], target)
    if run.virtual_clock and clients and row["clock_seconds"]:
        row["utilization"] = sum(r.virtual_busy or 0.0 for r in rounds) / (clients * row["clock_seconds"])
    return row


def run_row(run: Run, link: Link | None = None, target: float | None = None) -> dict[str, Any]:
    """The table row of one run: plain numbers (None where the run has no such number);
    ``target``: the accuracy of the times to target."""
    summary, rounds = run.summary, run.rounds
    logical = run.has_logical_bytes()
    code, code_source = run.exit_code_and_source()
    short = run.short_rounds()
    row: dict[str, Any] = {
        "row": "run", "group": run.group, "run": run.label, "algorithm": run.algorithm,
        **{f"seed_{source}": seed for source, seed in run.seeds.items()},
        "status": run.state, "exit_code": code, "exit_code_source": code_source,
        "failures": len(run.failures) + run.unlisted_missing_evaluations,
        "failure_list": "; ".join(run.failures + ([f"{run.unlisted_missing_evaluations} clients without a final "
                                                   "evaluation"] if run.unlisted_missing_evaluations else [])) or None,
        "short_rounds": len(short),
        "short_round_list": "; ".join(f"{number}: {done}/{sampled}" for number, done, sampled in short) or None,
        "rounds": len(rounds),
        "bytes_counted": "logical" if logical else "physical",
        "initial_acc": None, "personalized_acc": None, "finetune_epochs": None, "global_acc": None,
        "bytes_down_per_round": _per_round_mean(run, "down", logical),
        "bytes_up_per_round": _per_round_mean(run, "up", logical),
        "physical_bytes_down_per_round": _per_round_mean(run, "down", False),
        "physical_bytes_up_per_round": _per_round_mean(run, "up", False),
        "client_compute_seconds_per_round": _mean([r.client_compute_seconds for r in rounds]),
        "train_flops_per_round": _mean([r.train_flops for r in rounds]),
        "wall_seconds": None,
        **_clock_numbers(run, target),
    }
    if summary is not None:
        accuracy = summary.accuracy
        if accuracy.metric == "acc":
            row["initial_acc"] = accuracy.initial.mean
            epochs = accuracy.longest_finetune()
            if epochs is not None:
                row["personalized_acc"] = accuracy.personalized[epochs].mean
                row["finetune_epochs"] = int(epochs)
            row["global_acc"] = run.final_global_accuracy()
        row["wall_seconds"] = summary.seconds
    if link is not None:
        row.update(dict.fromkeys(c.key for c in LINK_COLUMNS))
        if run.has_client_entries():
            times = round_times(link, rounds, logical=uses_logical_bytes(rounds))
            cumulative = cumulative_seconds(times)
            row["link_seconds_per_round"] = _mean([t.seconds for t in times if t is not None])
            row["link_seconds_total"] = cumulative[-1]
            if target is not None:
                row["link_time_to_target"] = time_to_accuracy(rounds, cumulative, target)
    return row


def _status_counts(statuses: Sequence[str]) -> str:
    counts = {status: statuses.count(status) for status in dict.fromkeys(statuses)}
    return ", ".join(f"{count} {status}" for status, count in counts.items())


def group_row(name: str, rows: Sequence[dict[str, Any]], link: Link | None) -> dict[str, Any]:
    """The row of a group: each number's mean, sample standard deviation (two runs or more) and
    count over the group's runs that have it; what all runs share, once."""
    row: dict[str, Any] = {"row": "group", "group": name, "run": name, "n": len(rows)}
    for key in ("algorithm", *(f"seed_{s}" for s in SEED_SOURCES), "exit_code", "exit_code_source", "rounds",
                "bytes_counted", "finetune_epochs", "engine", "clock"):
        values = {r[key] for r in rows}
        row[key] = values.pop() if len(values) == 1 else None
    row["status"] = _status_counts([r["status"] for r in rows])
    if row["exit_code"] is None:
        row["exit_code_source"] = None
    row["failures"] = sum(r["failures"] for r in rows)
    row["short_rounds"] = sum(r["short_rounds"] for r in rows)
    for key in ("failure_list", "short_round_list"):
        row[key] = "; ".join(f"{r['run']}: {r[key]}" for r in rows if r[key]) or None
    for column in number_columns(link):
        values = [r[column.key] for r in rows if r[column.key] is not None]
        row[column.key] = _mean(values)
        row[f"{column.key}_std"] = statistics.stdev(values) if len(values) > 1 else None
        row[f"{column.key}_n"] = len(values)
    return row


def table_rows(runs: Sequence[Run], link: Link | None = None, target: float | None = None) -> list[dict[str, Any]]:
    """Each group's row followed by the rows of its runs, groups in the order of their first run."""
    rows = []
    for name, members in group_runs(runs).items():
        members_rows = [run_row(run, link, target) for run in members]
        rows.append(group_row(name, members_rows, link))
        rows += members_rows
    return rows


def number_columns(link: Link | None) -> list[Column]:
    return NUMBER_COLUMNS + (LINK_COLUMNS if link is not None else [])


def csv_keys(link: Link | None) -> list[str]:
    keys = [c.key for c in IDENTITY_COLUMNS] + ["n", FINETUNE_COLUMN.key]
    for column in number_columns(link):
        keys += [column.key, f"{column.key}_std", f"{column.key}_n"]
    return keys


def to_csv(rows: Sequence[dict[str, Any]], link: Link | None) -> str:
    """Full-precision CSV (floats as Python writes them, so they read back exactly; empty = none)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    keys = csv_keys(link)
    writer.writerow(keys)
    for row in rows:
        writer.writerow(["" if row.get(k) is None else row[k] for k in keys])
    return out.getvalue()


def columns(link: Link | None) -> list[Column]:
    """The columns of the readable table, in order."""
    every = {c.key: c for c in [*IDENTITY_COLUMNS, FINETUNE_COLUMN, *number_columns(link)]}
    return [every[key] for key in SHOWN_KEYS if key in every]


def cell(row: dict[str, Any], column: Column) -> str:
    """The rounded, readable cell ("-" where there is no number); a group's number of two runs or
    more as ``mean ± std (n)``."""
    value = row.get(column.key)
    if value is None:
        return "-"
    std = row.get(f"{column.key}_std")
    if row["row"] == "group" and row["n"] > 1 and f"{column.key}_n" in row:
        spread = f" ± {column.show(std)}" if std is not None else ""
        return f"{column.show(value)}{spread} ({row[f'{column.key}_n']})"
    return column.show(value)


def cells(row: dict[str, Any], link: Link | None) -> list[str]:
    return [cell(row, c) for c in columns(link)]


def readable_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of the comparison (a group's row; a group of one run: the run's row) and, where a
    group has several runs, the rows of those runs (else empty)."""
    groups = [r for r in rows if r["row"] == "group"]
    single = {r["group"] for r in groups if r["n"] == 1}
    comparison = [r for r in rows if (r["row"] == "group") != (r["group"] in single)]
    return comparison, [r for r in rows if r["row"] == "run" and r["group"] not in single]


def _markdown_table(rows: Sequence[dict[str, Any]], link: Link | None) -> list[str]:
    cols = columns(link)
    text = {"run", "status"}
    lines = ["| " + " | ".join(c.title for c in cols) + " |",
             "|" + "|".join("---" if c.key in text else "---:" for c in cols) + "|"]
    lines += ["| " + " | ".join(t.replace("|", "\\|") for t in cells(dict(row), link)) + " |" for row in rows]
    return lines


def to_markdown(rows: Sequence[dict[str, Any]], link: Link | None) -> str:
    """The comparison (groups of several runs as mean ± std (n)) and, where a group has several
    runs, a table of those runs."""
    comparison, seeded = readable_rows(rows)
    lines = _markdown_table(comparison, link)
    if seeded:
        lines += ["", "Runs of the groups above, one row each:", "", *_markdown_table(seeded, link)]
    return "\n".join(lines) + "\n"


ROUND_KEYS = ("run", "group", "algorithm", *(f"seed_{s}" for s in SEED_SOURCES), "round", "sampled", "completed",
              "train_loss", "lr", "global_acc", "global_loss", "seconds", "train_flops",
              "client_compute_seconds", "bytes_counted", "physical_down", "physical_up", "logical_down", "logical_up")


def _per_part_keys(runs: Sequence[Run]) -> list[str]:
    """Columns of bytes per model part (physical, logical) and per body unit (logical)."""
    parts: dict[str, None] = {}
    units: dict[str, None] = {}
    for run in runs:
        for record in run.rounds:
            parts.update(dict.fromkeys(record.bytes_by_part))
            parts.update(dict.fromkeys(record.logical.by_part if record.logical is not None else {}))
            units.update(dict.fromkeys(record.bytes_by_unit or {}))
    keys = [f"{kind}_{part}_{d}" for kind in ("physical", "logical") for part in parts for d in DIRECTIONS]
    return keys + [f"unit_{unit}_{d}" for unit in units for d in DIRECTIONS]


def round_rows(runs: Sequence[Run]) -> tuple[list[str], list[dict[str, Any]]]:
    """The header and rows of ``rounds.csv``: one row per run and round (empty: not recorded)."""
    keys = [*ROUND_KEYS, *_per_part_keys(runs)]
    rows = []
    for run in runs:
        for record in run.rounds:
            logical = record.logical
            global_metrics = record.global_metrics or ModelMetrics()
            row: dict[str, Any] = {
                "run": run.label, "group": run.group, "algorithm": run.algorithm,
                **{f"seed_{source}": seed for source, seed in run.seeds.items()},
                "round": record.round, "sampled": len(record.sampled), "completed": len(record.completed),
                "train_loss": record.train_loss, "lr": record.lr,
                "global_acc": global_metrics.acc, "global_loss": global_metrics.loss,
                "seconds": record.seconds, "train_flops": record.train_flops,
                "client_compute_seconds": record.client_compute_seconds,
                "bytes_counted": "logical" if logical is not None else "physical",
                "physical_down": record.bytes_down, "physical_up": record.bytes_up,
                "logical_down": logical.down if logical is not None else None,
                "logical_up": logical.up if logical is not None else None,
            }
            for kind, by_part in (("physical", record.bytes_by_part),
                                  ("logical", logical.by_part if logical is not None else {})):
                for part, counts in by_part.items():
                    for direction in DIRECTIONS:
                        row[f"{kind}_{part}_{direction}"] = counts.bytes_in(direction)
            for unit, counts in (record.bytes_by_unit or {}).items():
                for direction in DIRECTIONS:
                    row[f"unit_{unit}_{direction}"] = counts.bytes_in(direction)
            rows.append(row)
    return keys, rows


def rounds_csv(runs: Sequence[Run]) -> str:
    """``rounds.csv``: full precision, empty where a round did not record the number."""
    keys, rows = round_rows(runs)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(keys)
    for row in rows:
        writer.writerow(["" if row.get(k) is None else row[k] for k in keys])
    return out.getvalue()
