"""The report's HTML page: one self-contained file (inline CSS, figures embedded as PNG data
URIs, no script, nothing fetched), readable offline and when moved away from its folder."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from typing import Any

from fedpart.common.process.records import RunSummary
from fedpart.report.link import Link
from fedpart.report.runs import Run
from fedpart.report.tables import cells, columns, readable_rows

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto;
       max-width: 1400px; padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { margin-bottom: 0.2rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.6rem 0; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.wide { overflow-x: auto; } figure { margin: 1.2rem 0; } figure img { max-width: 100%; height: auto; }
figcaption { font-size: 0.9rem; color: #444; } .failed { color: #a33; font-weight: 600; }
.muted { color: #666; } code { background: #f4f4f4; padding: 0 0.2rem; }
"""
def _e(value: Any) -> str:
    return html.escape(str(value))


def _status(run: Run) -> str:
    """How the run ended and the server's exit code, red where anything went wrong."""
    code, source = run.exit_code_and_source()
    text = run.state + (f", exit {code}" + (" (derived from summary.json)" if source == "derived" else "")
                        if code is not None else ", exit code unknown")
    return f'<span class="failed">{_e(text)}</span>' if run.failed else _e(text)


def _runs_table(runs: Sequence[Run]) -> str:
    rows = []
    for run in runs:
        source = run.summary_file or RunSummary()
        config = run.config
        model = source.model or config.get("model", {}).get("name", "?")
        dataset = source.dataset or config.get("data", {}).get("dataset", "?")
        clients = source.clients or config.get("clients", "?")
        seeds = ", ".join(f"{k} {v}" for k, v in run.seeds.items())
        failures = len(run.failures) + run.unlisted_missing_evaluations
        short = len(run.short_rounds())
        rows.append(f"<tr><td>{_e(run.label)}</td><td><code>{_e(run.path)}</code></td><td>{_e(run.algorithm)}</td>"
                    f"<td>{_e(model)}</td><td>{_e(dataset)}</td><td class=num>{_e(clients)}</td><td>{_e(seeds)}</td>"
                    f"<td class=num>{len(run.rounds)} / {_e(run.configured_rounds or '?')}</td><td>{_status(run)}</td>"
                    f"<td class=num>{_failed_cell(failures)}</td><td class=num>{_failed_cell(short)}</td></tr>")
    return ('<div class="wide"><table><tr><th>run</th><th>directory</th><th>algorithm</th><th>model</th>'
            "<th>dataset</th><th>clients</th><th>seeds</th><th>rounds</th><th>status</th><th>failures</th>"
            "<th>rounds short of clients</th></tr>" + "".join(rows) + "</table></div>")


def _failed_cell(count: int) -> str:
    return f'<span class="failed">{count}</span>' if count else "0"


def _failures(runs: Sequence[Run]) -> list[str]:
    """One line per failure of every run: summary.json's list, evaluations missing, how the run
    ended, rounds that folded fewer clients than sampled."""
    lines = []
    for run in runs:
        code, source = run.exit_code_and_source()
        if not run.complete:
            lines.append(f"{run.label}: {run.state}" + (f" (exit {code}, {source})" if code is not None else "")
                         + f" after round {len(run.rounds)} of {run.configured_rounds or '?'}")
        elif code:
            lines.append(f"{run.label}: the server exited {code} ({source})")
        lines += [f"{run.label}: {failure}" for failure in run.failures]
        if run.unlisted_missing_evaluations:
            lines.append(f"{run.label}: {run.unlisted_missing_evaluations} clients reported no final evaluation")
        if not run.lists_its_shortfalls:
            lines += [f"{run.label}: round {number} folded {done} of {sampled} sampled clients"
                      for number, done, sampled in run.short_rounds()]
    return lines


def _comparison(rows: Sequence[Mapping[str, Any]], link: Link | None) -> str:
    """A table of ``rows`` in the comparison's columns."""
    cols = columns(link)
    head = "".join(f"<th>{_e(c.title)}</th>" for c in cols)
    body = []
    for row in rows:
        texts = cells(dict(row), link)
        body.append("<tr>" + "".join(
            f"<td{' class=num' if isinstance(row.get(c.key), (int, float)) else ''}>{_e(text)}</td>"
            for c, text in zip(cols, texts)) + "</tr>")
    return f'<div class="wide"><table><tr>{head}</tr>{"".join(body)}</table></div>'


def _list(items: Sequence[str]) -> str:
    return "<ul>" + "".join(f"<li>{_e(item)}</li>" for item in items) + "</ul>"


def render(runs: Sequence[Run], rows: Sequence[Mapping[str, Any]], figures: Sequence[tuple[str, str, str, bytes]],
           missing_figures: Sequence[str], link_notes: Sequence[str] | None, link: Link | None) -> str:
    """The page. ``figures`` are (file name, title, caption, PNG bytes); ``link_notes`` describe
    the link model as applied (None: no link was given)."""
    notes = [f"{run.label}: {note}" for run in runs for note in run.notes] + list(missing_figures)
    failures = _failures(runs)
    comparison, seeded = readable_rows(rows)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',
        f"<title>fedpart report: {_e(', '.join(r.label for r in runs))}</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>fedpart report</h1>",
        f'<p class="muted">{len(runs)} run{"s" if len(runs) != 1 else ""}; the numbers come from each run '
        "directory's <code>summary.json</code> and <code>metrics.jsonl</code>.</p>",
    ]
    if failures:
        failed = sum(1 for run in runs if run.failed or run.short_rounds())
        parts += [f'<h2 class="failed">Failures: {failed} of {len(runs)} run{"s" if len(runs) != 1 else ""}</h2>',
                  _list(failures)]
    parts += ["<h2>Runs</h2>", _runs_table(runs)]
    if notes:
        parts += ["<h2>What is missing</h2>", _list(notes)]
    parts += ["<h2>Comparison</h2>", _comparison(comparison, link),
              '<p class="muted">Accuracy: mean over clients on their own test splits (initial: the final '
              "global model with the client's personal parts; personalized: after the longest fine-tuning), "
              "and the global model on the server's test set. Bytes per round: mean over the training rounds, "
              "all clients; logical (each sampled client as its own device) where the run records them, else "
              "physical (see the notes), and the physical bytes (what crossed the connections) beside them. "
              "A group of runs that differ only in their seeds: mean ± sample standard deviation (runs with "
              "the number). The same numbers at full precision, with one row per run and per group: "
              "<code>table.csv</code>, <code>table.md</code>; every round of every run: "
              "<code>rounds.csv</code>.</p>"]
    if seeded:
        parts += ["<h3>Runs of each group</h3>", _comparison(seeded, link)]
    if link_notes is not None:
        parts += ["<h2>Time on a link</h2>", _list(link_notes)]
    elif runs:
        parts.append('<p class="muted">Give <code>--link RATE/RTT</code> (e.g. <code>10Mbit/50ms</code>) to turn '
                     "each round's bytes into time on that link.</p>")
    parts.append("<h2>Figures</h2>")
    for name, title, caption, png in figures:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<figure id="{_e(name)}"><h3>{_e(title)}</h3>'
                     f'<img src="data:image/png;base64,{data}" alt="{_e(title)}">'
                     f"<figcaption>{_e(caption)} <span class=muted>({_e(name)}.png)</span></figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
