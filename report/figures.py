"""The report's figures (matplotlib, object API on the Agg canvas: no display, no pyplot state).

Each figure is drawn from the runs' plain records; a figure that no run has data for is not drawn
and says why (:class:`Plot` with ``figure`` None), and a run missing from a figure is named in the
page's notes (:func:`fedpart.report.runs.read_run`). Runs that differ only in their seeds
form a group (:attr:`Run.group`): a group of several runs is drawn as its mean per round with a band
of one standard deviation, a group of one run as that run. Rounds that folded fewer clients than
sampled (in any run of a group) are marked with a red x on every per-round curve. Bytes are logical
(each sampled client as its own device) where every run records them, else physical, and every
caption says which.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, PercentFormatter

from fedpart.common.process.records import ByteCounts, RoundRecord
from fedpart.report.link import Link, cumulative_seconds, round_times, uses_logical_bytes
from fedpart.report.runs import Run, group_runs, round_bytes, round_bytes_by_part

WIDTH = 11.0       # inches; at DPI this is the page's figure width in pixels
PANEL_HEIGHT = 3.4
DPI = 100
LEGEND_ROW_INCHES = 0.25
LEGEND_CHAR_PIXELS = 7  # a generous width of one character of the legend's default font at DPI
CROWDED_RUNS = 5  # more groups than this: the distribution panel names groups by colour only
PART_COLORS = {"body": "#4c72b0", "head": "#dd8452", "other": "#8c8c8c", "control": "#55a868"}
EXTRA_PART_COLORS = ["#c44e52", "#8172b3", "#937860", "#da8bc3"]
_LINE_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]  # hollow, so that equal curves stay visible
_DIRECTIONS = {"up": ("up",), "down": ("down",), "total": ("up", "down")}
SHORT_ROUND_STYLE = {"linestyle": "none", "marker": "x", "color": "#ff0000", "markersize": 9, "markeredgewidth": 2,
                     "zorder": 4}
SHORT_ROUND_LABEL = "round that folded fewer clients than sampled"
BAND_ALPHA = 0.2
# The file name (without .png) of every figure a report can have, in page order.
FIGURE_NAMES = ("accuracy_rounds", "accuracy_bytes", "time_staleness", "bytes_per_round", "bytes_units",
                "compute_rounds", "personalization", "link_time")


@dataclass
class Plot:
    """One figure of the report: its file name, title and caption, or why it is missing."""

    name: str
    title: str
    caption: str
    figure: Figure | None = None
    missing: str | None = None

    def __post_init__(self) -> None:
        assert self.name in FIGURE_NAMES, f"figure {self.name!r} is not in FIGURE_NAMES"


def _styles(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """A colour, a hollow marker (and, past ten groups, a line style) per group, the same in every figure."""
    return {group: {"color": f"C{i % 10}", "marker": _MARKERS[i % len(_MARKERS)], "markersize": 5,
                    "markerfacecolor": "none", "linestyle": _LINE_STYLES[(i // 10) % len(_LINE_STYLES)]}
            for i, group in enumerate(group_runs(runs))}


def _group_label(members: Sequence[Run]) -> str:
    name = members[0].group
    return name if len(members) == 1 else f"{name} (mean ± std of {len(members)} runs)"


def _logical(runs: Sequence[Run]) -> bool:
    """Bytes are logical in the figures when every run with rounds records them."""
    with_rounds = [r for r in runs if r.rounds]
    return bool(with_rounds) and all(r.has_logical_bytes() for r in with_rounds)


def _bytes_kind(logical: bool) -> str:
    return ("logical bytes (each sampled client as its own device)" if logical else
            "physical bytes (what crossed each process's connection; not every run records logical bytes)")


Series = Callable[[Run], dict[int, float]]  # a run's value per round (rounds without one left out)


@dataclass
class Curve:
    """A group's curve: per round, the mean x and y over the runs that have the round, the
    standard deviation of y (0 for one run) and whether a run of the group folded fewer clients
    than sampled in it."""

    x: list[float]
    y: list[float]
    std: list[float]
    short: list[bool]


def _curve(members: Sequence[Run], y_of: Series, x_of: Series | None = None, per_round: bool = True) -> Curve | None:
    ys = [y_of(run) for run in members]
    xs = [x_of(run) if x_of is not None else {n: float(n) for n in y} for run, y in zip(members, ys)]
    short = {number for run in members for number, _, _ in run.short_rounds()} if per_round else set()
    rounds = sorted({n for y, x in zip(ys, xs) for n in y if n in x})
    if not rounds:
        return None
    curve = Curve([], [], [], [])
    for number in rounds:
        values = [(x[number], y[number]) for x, y in zip(xs, ys) if number in y and number in x]
        curve.x.append(statistics.fmean(v for v, _ in values))
        curve.y.append(statistics.fmean(v for _, v in values))
        curve.std.append(statistics.stdev(v for _, v in values) if len(values) > 1 else 0.0)
        curve.short.append(number in short)
    return curve


def _draw(ax: Any, runs: Sequence[Run], shown: Sequence[Run], y_of: Series, x_of: Series | None = None,
          per_round: bool = True) -> list[str]:
    """The curve of every group of ``shown`` (mean, band, short rounds marked where the keys of
    ``y_of`` are rounds) on ``ax``, styled as in every figure of ``runs``; the groups drawn."""
    styles, drawn = _styles(runs), []
    for group, members in group_runs(shown).items():
        curve = _curve(members, y_of, x_of, per_round)
        if curve is None:
            continue
        drawn.append(group)
        ax.plot(curve.x, curve.y, label=_group_label(members), **styles[group])
        if len(members) > 1:
            ax.fill_between(curve.x, [m - s for m, s in zip(curve.y, curve.std)],
                            [m + s for m, s in zip(curve.y, curve.std)], color=styles[group]["color"],
                            alpha=BAND_ALPHA, linewidth=0)
        marked = [(x, y) for x, y, short in zip(curve.x, curve.y, curve.short) if short]
        if marked:
            ax.plot(*zip(*marked), label=SHORT_ROUND_LABEL, **SHORT_ROUND_STYLE)
    return drawn


def _short_note(runs: Sequence[Run]) -> str:
    return (" A red x marks a round that folded fewer clients than it sampled (in any run of a group)."
            if any(run.short_rounds() for run in runs) else "")


def _band_note(runs: Sequence[Run]) -> str:
    return (" Groups of several runs (seeds): their mean per round, the band one standard deviation either side."
            if any(len(m) > 1 for m in group_runs(runs).values()) else "")


def _global_accuracy(run: Run) -> dict[int, float]:
    return dict(run.global_accuracy())


def _train_loss(run: Run) -> dict[int, float]:
    return {rec.round: rec.train_loss for rec in run.rounds if rec.train_loss is not None}


def _figure(panels: int, rows: int = 1, height: float = PANEL_HEIGHT, **kwargs: Any) -> tuple[Figure, Any]:
    figure = Figure(figsize=(WIDTH, height * rows), dpi=DPI, layout="constrained")
    axes = figure.subplots(rows, panels, squeeze=False, **kwargs)
    return figure, axes


def _legend(figure: Figure, axes: Sequence[Any]) -> None:
    """One legend for the figure, below the panels, from the labels of all its axes."""
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        entry_pixels = 45 + LEGEND_CHAR_PIXELS * max(len(label) for label in labels)  # marker, gap and text
        columns = max(1, min(len(labels), int(WIDTH * DPI // entry_pixels)))
        rows = -(-len(labels) // columns)
        figure.set_figheight(figure.get_figheight() + LEGEND_ROW_INCHES * (rows - 1))  # the panels keep their height
        figure.legend(handles, labels, loc="outside lower center", ncols=columns, frameon=False)


def _percent_axis(ax: Any) -> None:
    """Fractions on the y axis as percentages, with as many decimals as the axis's range needs."""
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))


def accuracy_per_round(runs: Sequence[Run]) -> Plot:
    with_accuracy = [r for r in runs if r.global_accuracy()]
    with_loss = [r for r in runs if _train_loss(r)]
    panels = [(name, shown) for name, shown in (("acc", with_accuracy), ("loss", with_loss)) if shown]
    title = {"acc": "accuracy", "loss": "training loss"}
    plot = Plot("accuracy_rounds", " and ".join(title[n] for n, _ in panels).capitalize() + " per round"
                if panels else "Accuracy and training loss per round", "")
    if not panels:
        plot.missing = "no run has rounds with an accuracy or a training loss"
        return plot
    describe = {"acc": "the global model's accuracy on the server's test set every evaluate.global_every rounds",
                "loss": "the sample-weighted training loss of the round's clients"}
    where = [" (left)", " (right)"] if len(panels) == 2 else [""]
    plot.caption = ("Per round: " + " and ".join(describe[n] + w for (n, _), w in zip(panels, where)) + "."
                    + ("" if with_accuracy else " No run has accuracy per round (see the notes).")
                    + _band_note(runs) + _short_note(runs))
    figure, axes = _figure(len(panels))
    for ax, (panel, shown) in zip(axes[0], panels):
        if panel == "acc":
            _draw(ax, runs, shown, _global_accuracy)
            ax.set_ylabel("global test accuracy")
            _percent_axis(ax)
        else:
            _draw(ax, runs, shown, _train_loss)
            ax.set_ylabel("training loss")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    _legend(figure, axes[0])
    plot.figure = figure
    return plot


def _cumulative_bytes(direction: str, logical: bool) -> Series:
    """A run's bytes so far (MB) at the end of each round, in ``direction`` (up, down, total)."""
    def series(run: Run) -> dict[int, float]:
        total, out = 0, {}
        for rec in run.rounds:
            total += sum(round_bytes(rec, d, logical) for d in _DIRECTIONS[direction])
            out[rec.round] = total / 1e6
        return out
    return series


def accuracy_per_byte(runs: Sequence[Run]) -> Plot:
    logical = _logical(runs)
    plot = Plot("accuracy_bytes", "Accuracy vs bytes communicated",
                f"Global test accuracy against the {_bytes_kind(logical)} sent so far over the training rounds "
                "(cumulative, all clients), uploaded, downloaded and in total: the communication-efficiency curve.")
    per_round = [r for r in runs if r.global_accuracy()]
    final_only = [r for r in runs if not r.global_accuracy() and r.final_global_accuracy() is not None]
    if not per_round and not final_only:
        plot.missing = ("no run has a global test accuracy (per round: set evaluate.global_every; after the last "
                        "round: a finished run whose server tests a complete global model)")
        return plot
    if final_only:
        plot.caption += (" A run without accuracy per round (evaluate.global_every 0) is one filled point: its final "
                         "global model against the bytes of all its rounds" +
                         (" (a group of several runs: the mean, with a bar of one standard deviation)."
                          if any(len(m) > 1 for m in group_runs(final_only).values()) else "."))
    if not per_round:
        plot.caption += " No run has accuracy per round, so there are no curves."
    plot.caption += _band_note(per_round) + _short_note(per_round)
    styles = _styles(runs)
    figure, axes = _figure(3, sharey=True)
    for ax, direction in zip(axes[0], ("up", "down", "total")):
        _draw(ax, runs, per_round, _global_accuracy, _cumulative_bytes(direction, logical))
        for group, members in group_runs(final_only).items():
            sent = [_cumulative_bytes(direction, logical)(run) for run in members]
            x = [s[max(s)] if s else 0.0 for s in sent]
            y = [run.final_global_accuracy() for run in members]
            style = {**styles[group], "markerfacecolor": styles[group]["color"], "markersize": 8}
            ax.errorbar([statistics.fmean(x)], [statistics.fmean(y)],
                        yerr=[statistics.stdev(y)] if len(y) > 1 else None, capsize=4,
                        label=f"{_group_label(members)}, final global model", **style)
        ax.set_xlabel(f"MB {'sent' if direction == 'total' else direction + 'loaded'}, cumulative "
                      f"({'logical' if logical else 'physical'})")
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("global test accuracy")
    _percent_axis(axes[0][0])
    _legend(figure, axes[0])
    plot.figure = figure
    return plot


def time_and_staleness(runs: Sequence[Run], target: float | None) -> Plot:
    """Global accuracy against each run's own time (virtual where every run shown ran the virtual
    clock, else the server's wall time), and the staleness of the buffered runs' folded results."""
    timed = [r for r in runs if r.virtual_clock or r.staleness()]
    with_accuracy = [r for r in timed if r.global_accuracy()]
    buffered = [r for r in timed if r.staleness()]
    virtual = bool(with_accuracy) and all(r.virtual_clock for r in with_accuracy)
    plot = Plot("time_staleness", "Accuracy against time, and staleness", "")
    if not with_accuracy and not buffered:
        plot.missing = ("no run ran the virtual clock (heterogeneity.clock: virtual) or the buffered engine with "
                        "accuracy per round (evaluate.global_every)")
        return plot
    clock = ("virtual time (heterogeneity.clock: virtual: the devices' simulated time)" if virtual else
             "the server's wall time (not every run shown ran the virtual clock)")
    parts = []
    if with_accuracy:
        parts.append(f"global test accuracy against {clock}"
                     + ("; the dotted line is the target of the times to target" if target is not None else ""))
    if buffered:
        parts.append("the share of each buffered run's folded results by staleness (server versions between the "
                     "version a task trained on and the one it was folded into)")
    where = [" (left)", " (right)"] if len(parts) == 2 else [""]
    plot.caption = "; ".join(p + w for p, w in zip(parts, where)).capitalize() + "." + _band_note(with_accuracy)
    figure, axes = _figure(len(parts))
    if with_accuracy:
        ax = axes[0][0]
        _draw(ax, runs, with_accuracy, _global_accuracy,
              Run.clock_seconds if virtual else Run.wall_seconds)
        if target is not None:
            ax.axhline(target, color="black", linestyle=":", linewidth=1)
        ax.set_xlabel(f"{'virtual' if virtual else 'wall'} time, s")
        ax.set_ylabel("global test accuracy")
        ax.grid(alpha=0.3)
        _percent_axis(ax)
    if buffered:
        ax = axes[0][-1]
        styles = _styles(runs)
        width = 0.8 / len(buffered)
        for index, run in enumerate(buffered):
            counts = run.staleness()
            total = sum(counts.values())
            ax.bar([s - 0.4 + width * (index + 0.5) for s in counts], [n / total for n in counts.values()], width,
                   color=styles[run.group]["color"], label=run.label if run.label != run.group else run.group)
        ax.set_xlabel("staleness (server versions)")
        ax.set_ylabel("share of folded results")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(axis="y", alpha=0.3)
        _percent_axis(ax)
    _legend(figure, axes[0])
    plot.figure = figure
    return plot


def _parts(runs: Sequence[Run], logical: bool) -> list[str]:
    """Model parts that carried bytes in any run, in the ledger's order (control last)."""
    seen: list[str] = []
    for run in runs:
        for rec in run.rounds:
            for part, counts in round_bytes_by_part(rec, logical).items():
                if part not in seen and (counts.down or counts.up):
                    seen.append(part)
    return [p for p in seen if p != "control"] + (["control"] if "control" in seen else [])


def _round_means(members: Sequence[Run], value: Callable[[RoundRecord], float]) -> dict[int, float]:
    """Per round, the mean of ``value`` over the group's runs that have the round."""
    by_round: dict[int, list[float]] = {}
    for run in members:
        for rec in run.rounds:
            by_round.setdefault(rec.round, []).append(value(rec))
    return {number: statistics.fmean(values) for number, values in sorted(by_round.items())}


def _stacked_rows(runs: Sequence[Run], plot: Plot, keys: Sequence[str], colors: dict[str, str],
                  share: Callable[[RoundRecord, str, str], float], physical_total: bool) -> None:
    """One row of two panels (downloads, uploads) per group, bars stacked by ``keys`` (``share``:
    a round record's kB of a key in a direction), the group's mean per round; with
    ``physical_total`` a black dash at each round's physical total; short rounds marked."""
    groups = group_runs([r for r in runs if r.rounds])
    figure, axes = _figure(2, rows=len(groups), height=2.4, sharex=True, sharey="col")
    for row, members in zip(axes, groups.values()):
        short = {number for run in members for number, _, _ in run.short_rounds()}
        for ax, direction in zip(row, ("down", "up")):
            bottom: dict[int, float] = {}
            for key in keys:
                means = _round_means(members, lambda rec: share(rec, key, direction))
                ax.bar(list(means), list(means.values()), bottom=[bottom.get(n, 0.0) for n in means], width=0.8,
                       color=colors[key], label=key)
                for number, value in means.items():
                    bottom[number] = bottom.get(number, 0.0) + value
            if physical_total:
                physical = _round_means(members, lambda rec: rec.bytes_in(direction) / 1e3)
                ax.plot(list(physical), list(physical.values()), linestyle="none", marker="_", markersize=12,
                        markeredgewidth=2, color="black", label="physical total (what crossed the connections)")
            marked = [(n, bottom.get(n, 0.0)) for n in sorted(short)]
            if marked:
                ax.plot(*zip(*marked), label=SHORT_ROUND_LABEL, **SHORT_ROUND_STYLE)
            ax.set_title(f"{_group_label(members)}: {direction}", fontsize="medium", loc="left")
            ax.set_ylabel("kB")
            ax.grid(axis="y", alpha=0.3)
            ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[-1]:
        ax.set_xlabel("round")
    _legend(figure, [ax for row in axes for ax in row])
    plot.figure = figure


def bytes_per_round(runs: Sequence[Run]) -> Plot:
    logical = _logical(runs)
    plot = Plot("bytes_per_round", "Bytes per round by part and direction",
                f"The {_bytes_kind(logical)} of each round, stacked by model part (tensor bytes of body, head and "
                "other parts; control: headers, plans, metrics, polls), downloads left, uploads right"
                + ("; the black dash is the round's physical total, what crossed the connections (a process "
                   "hosting several clients downloads a changed tensor once)." if logical else ".")
                + (" A group of several runs: the mean per round." if any(len(m) > 1 for m in group_runs(runs).values())
                   else "") + _short_note(runs))
    if not any(r.rounds for r in runs):
        plot.missing = "no run has rounds"
        return plot
    parts = _parts(runs, logical)
    extra = iter(EXTRA_PART_COLORS * 4)
    colors = {p: PART_COLORS.get(p) or next(extra) for p in parts}
    _stacked_rows(runs, plot, parts, colors,
                  lambda rec, part, d: _bytes_in(round_bytes_by_part(rec, logical).get(part), d) / 1e3, logical)
    return plot


def _bytes_in(counts: ByteCounts | None, direction: str) -> float:
    """The bytes of ``counts`` in ``direction`` (0: none recorded)."""
    return counts.bytes_in(direction) if counts is not None else 0


def bytes_per_unit(runs: Sequence[Run]) -> Plot:
    shown = [r for r in runs if r.rounds and all(rec.bytes_by_unit is not None for rec in r.rounds)]
    plot = Plot("bytes_units", "Bytes per body unit and round",
                "Logical tensor bytes of each schedule unit (the body's units, e.g. conv1, conv2, fc1, and the head) per round, "
                "stacked, downloads left, uploads right: which units a freeze or expansion schedule sends"
                + (" (a group of several runs: the mean per round)." if any(len(m) > 1 for m in
                                                                            group_runs(shown).values()) else ".")
                + _short_note(shown))
    if not shown:
        plot.missing = "no run records bytes per body unit (bytes_by_unit in metrics.jsonl)"
        return plot
    units: list[str] = []
    for run in shown:
        for rec in run.rounds:
            units += [u for u in rec.bytes_by_unit if u not in units]
    colors = {unit: f"C{i % 10}" for i, unit in enumerate(units)}
    _stacked_rows(shown, plot, units, colors,
                  lambda rec, unit, d: _bytes_in(rec.bytes_by_unit.get(unit), d) / 1e3, False)
    return plot


def compute_per_round(runs: Sequence[Run]) -> Plot:
    plot = Plot("compute_rounds", "Trainable parameters and training FLOPs per round",
                "Trainable parameters per client (sample-weighted over the round's clients) and the training "
                "FLOPs of the round, all clients (forward plus the backward actually run): what a freeze "
                "schedule saves." + _band_note(runs) + _short_note(runs))
    shown = [r for r in runs if r.rounds]
    if not shown:
        plot.missing = "no run has rounds"
        return plot
    figure, axes = _figure(2)
    for ax, key, label in zip(axes[0], ("trainable_parameters", "train_flops"),
                              ("trainable parameters per client", "training FLOPs, all clients")):
        _draw(ax, runs, shown, lambda run, key=key: {rec.round: getattr(rec, key) for rec in run.rounds
                                                    if getattr(rec, key) is not None})
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(EngFormatter())
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    _legend(figure, axes[0])
    plot.figure = figure
    return plot


def _sweep(run: Run) -> dict[int, float]:
    """Mean client accuracy after each number of fine-tune epochs (0: initial)."""
    accuracy = run.summary.accuracy
    points = {0: accuracy.initial.mean}
    points.update({int(e): s.mean for e, s in accuracy.personalized.items() if s.mean is not None})
    return points


def personalization(runs: Sequence[Run]) -> Plot:
    plot = Plot("personalization", "Personalization",
                "Left: mean accuracy over clients on their own test splits after tau_f fine-tune epochs "
                "(0: the final global model with the client's personal parts). Right: the per-client "
                "accuracies before (initial) and after the longest fine-tuning (personalized).")
    shown = [r for r in runs if r.summary is not None and r.summary.accuracy.metric == "acc"
             and r.summary.accuracy.initial.mean is not None]
    if not shown:
        plot.missing = "no finished run reported client accuracies (the final evaluation is in summary.json)"
        return plot
    groups = group_runs(shown)
    if any(len(m) > 1 for m in groups.values()):
        plot.caption += (" A group of several runs: left, the mean over its runs with a band of one standard "
                         "deviation; right, the clients of all its runs.")
    styles = _styles(runs)
    figure, axes = _figure(2)
    sweep, spread = axes[0]
    _draw(sweep, runs, shown, _sweep, per_round=False)
    sweep.set_xlabel("fine-tune epochs (tau_f)")
    sweep.set_ylabel("mean client accuracy")
    sweep.xaxis.get_major_locator().set_params(integer=True)
    sweep.grid(alpha=0.3)
    _percent_axis(sweep)
    positions, data, colors, ticks = [], [], [], []
    for index, (group, members) in enumerate(groups.items()):
        initial, final = [], []
        epochs = members[0].summary.accuracy.longest_finetune()
        for run in members:
            clients = run.summary.per_client
            initial += [c.initial for c in clients if c.initial is not None]
            final += [c.personalized[epochs] for c in clients
                      if epochs is not None and c.personalized.get(epochs) is not None]
        for offset, values, kind in ((-0.2, initial, "initial"), (0.2, final, f"{epochs} ep")):
            if values:
                positions.append(index + offset)
                data.append(values)
                colors.append(styles[group]["color"])
                ticks.append((index + offset, kind))
    boxes = spread.boxplot(data, positions=positions, widths=0.32, patch_artist=True, showfliers=False)
    for box, color, (offset, kind) in zip(boxes["boxes"], colors, ticks):
        box.set_facecolor(color)
        box.set_alpha(0.35 if kind == "initial" else 0.75)
    for median in boxes["medians"]:
        median.set_color("black")
    for position, values, color in zip(positions, data, colors):
        spread.scatter([position] * len(values), values, s=9, color=color, zorder=3, edgecolors="none")
    crowded = len(groups) > CROWDED_RUNS  # then the colours (legend) name the groups
    spread.set_xticks([p for p, _ in ticks], [k for _, k in ticks], fontsize="x-small" if crowded else "small",
                      rotation=90 if crowded else 0)
    for index, group in enumerate(groups if not crowded else []):
        spread.annotate(group, (index, 0), xycoords=("data", "axes fraction"), xytext=(0, -28),
                        textcoords="offset points", ha="center", va="top", fontsize="small")
    spread.set_ylabel("client accuracy")
    spread.set_xlim(-0.6, len(groups) - 0.4)
    spread.grid(axis="y", alpha=0.3)
    _percent_axis(spread)
    _legend(figure, [sweep])
    plot.figure = figure
    return plot


def _link_times(link: Link) -> tuple[Series, Series]:
    """A run's modelled time so far and of each round, from its logical bytes where recorded."""
    def times(run: Run) -> list:
        return round_times(link, run.rounds, logical=uses_logical_bytes(run.rounds))

    def so_far(run: Run) -> dict[int, float]:
        return {rec.round: s for rec, s in zip(run.rounds, cumulative_seconds(times(run)))}

    def per_round(run: Run) -> dict[int, float]:
        return {rec.round: t.seconds for rec, t in zip(run.rounds, times(run)) if t is not None}
    return so_far, per_round


def time_on_link(runs: Sequence[Run], link: Link, target: float | None) -> Plot:
    shown = [r for r in runs if r.has_client_entries()]
    logical = bool(shown) and all(uses_logical_bytes(r.rounds) for r in shown)
    with_accuracy = [r for r in shown if r.global_accuracy()]
    plot = Plot("link_time", "Time on the link",
                f"Modelled time ({link.describe()}) from each client's {_bytes_kind(logical)}: "
                + ("global test accuracy against the modelled time so far (left; the dotted line is the target) "
                   "and the modelled time of each round (right)." if with_accuracy else
                   "the modelled time of each round (no run has accuracy per round).")
                + _band_note(shown) + _short_note(shown))
    if not shown:
        plot.missing = "no run has per-client bytes and compute seconds in metrics.jsonl"
        return plot
    so_far, per_round = _link_times(link)
    figure, axes = _figure(2 if with_accuracy else 1)
    if with_accuracy:
        ax = axes[0][0]
        _draw(ax, runs, with_accuracy, _global_accuracy, so_far)
        if target is not None:
            ax.axhline(target, color="black", linestyle=":", linewidth=1)
        ax.set_xlabel("modelled time, s")
        ax.set_ylabel("global test accuracy")
        ax.grid(alpha=0.3)
        _percent_axis(ax)
    ax = axes[0][-1]
    _draw(ax, runs, shown, per_round)
    ax.set_xlabel("round")
    ax.set_ylabel("modelled round time, s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _legend(figure, axes[0])
    plot.figure = figure
    return plot


def all_plots(runs: Sequence[Run], link: Link | None, target: float | None) -> list[Plot]:
    """Every figure of the report, in page order."""
    plots = [accuracy_per_round(runs), accuracy_per_byte(runs), time_and_staleness(runs, target),
             bytes_per_round(runs), bytes_per_unit(runs), compute_per_round(runs), personalization(runs)]
    if link is not None:
        plots.append(time_on_link(runs, link, target))
    return plots
