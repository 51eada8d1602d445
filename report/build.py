"""``fedpart report``: run directories in, a report folder out (``index.html``, ``table.csv``,
``table.md``, ``rounds.csv`` and one PNG per figure). Needs the ``report`` extra (matplotlib)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedpart.report.link import Link, default_target, process_bytes, uses_logical_bytes
from fedpart.report.runs import ReportError, Run, read_runs
from fedpart.report.tables import rounds_csv, table_rows, to_csv, to_markdown

PAGE = "index.html"
TABLES = ("table.csv", "table.md", "rounds.csv")
MISSING_EXTRA = "fedpart report needs matplotlib: pip install 'fedpart[report]'"


def require_plotting() -> None:
    """Refuse, naming the extra to install, when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401 - only whether it imports
    except ImportError as error:
        raise ReportError(f"{MISSING_EXTRA} ({error})") from error


def prepare_out_dir(out: Path, overwrite: bool) -> None:
    """An output folder to write into: a new or empty one, or with ``overwrite`` one whose earlier
    report files are removed (other files stay). Needs matplotlib (:func:`require_plotting`)."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        from fedpart.report.figures import FIGURE_NAMES

        if not overwrite:
            raise ReportError(f"--out {out}: exists and is not empty; give --overwrite to replace the report in it")
        for name in (PAGE, *TABLES, *(f"{n}.png" for n in FIGURE_NAMES)):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


@dataclass
class Report:
    """What a report wrote, and the numbers of its table."""

    out: Path
    page: Path
    figures: list[Path]
    rows: list[dict]  # table.csv's: each group's row, then its runs' rows
    missing: list[str]  # figures not drawn, and why
    target: float | None


def _link_notes(runs: Sequence[Run], link: Link, target: float | None, target_given: bool) -> list[str]:
    notes = [f"Link of every client: {link.describe()}.",
             "Per round, over the clients that completed it: each client downloads its task (bytes / downlink "
             "rate), trains for the compute seconds it measured, uploads its result (bytes / uplink rate), and "
             "adds round trips x RTT; clients run in parallel and the round lasts as long as the slowest"
             + ("; the transfers of a direction share the server's link fairly." if link.server is not None else "."),
             "Not modelled: the server's aggregation time, and sampled clients that did not complete."]
    physical = [run.label for run in runs if run.has_client_entries() and not uses_logical_bytes(run.rounds)]
    notes.append("Bytes: each client's logical bytes (what it would send and receive as its own device)"
                 + (f"; physical bytes for {', '.join(physical)}, whose metrics.jsonl has no logical bytes (a "
                    "process hosting several clients downloads a changed tensor once, for its first client)"
                    if physical else "") + ".")
    if target is None:
        notes.append("No time to accuracy: no run has accuracy per round.")
    else:
        how = "given with --target" if target_given else "the highest accuracy every run reaches (the default)"
        notes.append(f"Target accuracy {100 * target:.2f}% ({how}); time to target is the modelled time at the "
                     "end of the first tested round that reaches it.")
    for run in runs:
        if not run.has_client_entries():
            continue
        left_out = sum(process_bytes(r) for r in run.rounds)
        total = sum(r.bytes_down + r.bytes_up for r in run.rounds)
        dropped = sum(len(r.sampled) - len(r.completed) for r in run.rounds)
        share = f" ({100 * left_out / total:.2f}% of its round bytes)" if total else ""
        notes.append(f"{run.label}: {left_out:,} bytes of process-level control (joins, heartbeats, idle polls) "
                     f"left out{share}" + (f"; {dropped} sampled clients did not complete" if dropped else ""))
    return notes


def write_report(run_dirs: Sequence[str | Path], out: str | Path, link: Link | None = None,
                 target: float | None = None, overwrite: bool = False,
                 labels: Sequence[str] | None = None) -> Report:
    """Read ``run_dirs``, write the report into ``out``; refuses a non-empty ``out`` unless
    ``overwrite``. ``target``: accuracy in [0, 1] for time to accuracy (default: the highest
    accuracy every run reaches)."""
    require_plotting()
    if not run_dirs:
        raise ReportError("no run directory given")
    if target is not None and not 0.0 < target <= 1.0:
        raise ReportError(f"--target {target}: an accuracy in (0, 1] (or a percentage such as 90%)")
    if target is not None and link is None:
        raise ReportError("--target is the accuracy for the time to accuracy on a link: give --link too")
    runs = read_runs(run_dirs, labels)
    out = Path(out)
    prepare_out_dir(out, overwrite)

    from fedpart.report.figures import all_plots
    from fedpart.report.page import render

    target_given = target is not None
    if target is None:
        target = default_target([[a for _, a in run.global_accuracy()] for run in runs])
    rows = table_rows(runs, link, target)
    (out / "table.csv").write_text(to_csv(rows, link))
    (out / "table.md").write_text(to_markdown(rows, link))
    (out / "rounds.csv").write_text(rounds_csv(runs))
    figures, written, missing = [], [], []
    for plot in all_plots(runs, link, target):
        if plot.figure is None:
            missing.append(f"figure '{plot.title}' not drawn: {plot.missing}")
            continue
        buffer = io.BytesIO()
        plot.figure.savefig(buffer, format="png")
        png = buffer.getvalue()
        path = out / f"{plot.name}.png"
        path.write_bytes(png)
        written.append(path)
        figures.append((plot.name, plot.title, plot.caption, png))
    link_notes = _link_notes(runs, link, target, target_given) if link is not None else None
    page = out / PAGE
    page.write_text(render(runs, rows, figures, missing, link_notes, link))
    return Report(out=out, page=page, figures=written, rows=rows, missing=missing, target=target)
