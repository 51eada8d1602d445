"""What the server prints of its records: a round's progress line and the final result table."""

from __future__ import annotations

from fedpart.common.process.records import ClientStats, RoundRecord, RunSummary


def _fmt(value: float | None, scale: float = 100.0) -> str:
    return "-" if value is None else f"{value * scale:6.2f}"


def format_round(record: RoundRecord, rounds: int) -> str:
    """One readable progress line."""
    loss = record.train_loss
    return (f"round {record.round:>4}/{rounds}  clients {len(record.completed)}/{len(record.sampled)}  "
            f"loss {'-' if loss is None else f'{loss:.4f}'}  lr {record.lr:.4g}  "
            f"down {record.bytes_down / 1e6:.3f} MB  up {record.bytes_up / 1e6:.3f} MB  "
            f"{record.seconds:.2f} s")


def format_table(summary: RunSummary) -> str:
    """The final result table printed on stdout (of a completed run's summary)."""
    acc = summary.accuracy
    metric = acc.metric
    scale = 100.0 if metric == "acc" else 1.0
    unit = "accuracy %" if metric == "acc" else "loss"
    rows: list[tuple[str, ClientStats | None]] = [("initial (global model)", acc.initial)]
    rows += [(f"personalized, {e} epochs", s) for e, s in acc.personalized.items()]
    rows += [("head-less, euclidean", acc.headless), ("head-less, cosine", acc.headless_cosine)]
    parameters = summary.parameters
    lines = [
        f"{summary.algorithm} | {summary.model} on {summary.dataset} | {summary.clients} clients | "
        f"{summary.rounds} rounds | {parameters.total:,} parameters "
        f"(body {parameters.body:,}, head {parameters.head:,})",
        f"{'evaluation':<30}{unit + ' mean':>18}{'std':>9}{'weighted':>10}{'clients':>9}",
    ]
    for name, s in rows:
        if s is not None:
            lines.append(f"{name:<30}{_fmt(s.mean, scale):>18}{_fmt(s.std, scale):>9}"
                         f"{_fmt(s.weighted_mean, scale):>10}{s.clients:>9}")
    global_value = acc.global_value()
    if global_value is not None:
        lines.append(f"{'global model, server test set':<30}{_fmt(global_value, scale):>18}")
    b = summary.bytes
    lines.append(f"bytes down {b.down:,}  up {b.up:,}  (per round: down {b.per_round_mean.down:,.0f}, "
                 f"up {b.per_round_mean.up:,.0f})")
    logical = b.logical
    lines.append(f"logical bytes (each client its own device) down {logical.down:,}  up {logical.up:,}  "
                 f"(per round: down {logical.per_round_mean.down:,.0f}, up {logical.per_round_mean.up:,.0f})")
    parts = ", ".join(f"{p} {v.down:,}/{v.up:,}" for p, v in b.by_part.items())
    lines.append(f"by part (down/up): {parts}")
    ratios = ", ".join(f"{d} {b.compression_ratio[d]:.2f}x" for d, by_encoding in b.encodings.items()
                       if set(by_encoding) - {"none"})
    if ratios:
        lines.append(f"compression (decoded / wire tensor bytes): {ratios}")
    robust = summary.robust
    if robust is not None and robust.evaluation_samples_capped:
        lines.append("evaluation sample counts capped (more than the client can have): clients "
                     + ", ".join(str(c) for c in robust.evaluation_samples_capped))
    for client, entry in ((robust.insiders if robust is not None else None) or {}).items():
        named = entry.named_in_rounds
        lines.append(f"INSIDER? client {client}: an outlier in {entry.outlier_results} results, named by the "
                     f"insider monitor in {len(named)} rounds ({named[0]}-{named[-1]})")
    if summary.failures:
        lines.append(f"FAILURES ({len(summary.failures)}): " + "; ".join(summary.failures[:5]))
    return "\n".join(lines)
