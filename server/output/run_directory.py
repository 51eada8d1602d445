"""The run directory a server writes (docs/output.md): the resolved config, a line of
``metrics.jsonl`` per round, checkpoints and ``summary.json``, whose content
:func:`build_summary` makes from the round records, the final evaluation and the byte ledger."""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import yaml

from fedpart.common.process.checkpoint import save_tensors
from fedpart.common.config.run_config import CheckpointConfig, ConfigError, RunConfig
from fedpart.common.process.records import (
    Accuracy,
    ByteCounts,
    ClientResult,
    ClientStats,
    Compute,
    DeliveryCounts,
    EncodedBytes,
    LogicalBytes,
    ModelMetrics,
    NamedInsider,
    Parameters,
    RobustCounts,
    RoundRecord,
    RunBytes,
    RunDelivery,
    RunPrivacy,
    RunRobust,
    RunSummary,
    by_key,
)
from fedpart.common.ml.split_model import count_parameters
from fedpart.server.output.accounting import ByteLedger
from fedpart.server.engine.run_state import ResumeError
from fedpart.server.policy.validation import SAMPLE_COUNTS, reported

CHECKPOINTS = "checkpoints"
# summary.json's "status": how the run ended
COMPLETED, INTERRUPTED, FAILED = "completed", "interrupted", "failed"


def check_new_run_dir(out_dir: str | Path, overwrite: bool = False) -> None:
    """Refuse (ConfigError) to start a new run in ``out_dir`` when that would destroy anything:
    an earlier run is continued with ``--resume`` or replaced with ``--overwrite``; a non-empty
    directory that holds no run (no config.yaml) is never written into. Writes nothing."""
    path = Path(out_dir)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"--out {path} is a file, not a run directory")
    if not any(path.iterdir()):
        return
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"--out {path} is not empty and holds no fedpart run (no config.yaml); "
                          "choose another --out (--overwrite replaces only a run directory)")
    if not overwrite:
        raise ConfigError(f"--out {path} already holds a run: continue it with `fedpart server --resume {path}`, "
                          "replace it with --overwrite, or choose another --out")


class RunDirectory:
    """Writes everything a run leaves behind in its out dir."""

    def __init__(self, out_dir: str | Path, checkpoints: CheckpointConfig | None = None, resume: bool = False,
                 overwrite: bool = False) -> None:
        """A new run starts an empty metrics.jsonl; a resumed one keeps it (see :meth:`rounds_up_to`).
        With ``overwrite`` the earlier run in ``out_dir`` is removed first (call only once the
        server listens and everything was checked: :func:`check_new_run_dir`)."""
        self.path = Path(out_dir)
        self.checkpoints = checkpoints or CheckpointConfig()
        if overwrite and not resume:
            check_new_run_dir(self.path, overwrite=True)
            for entry in self.path.iterdir() if self.path.is_dir() else ():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        if not resume:
            self.metrics_path.write_text("")

    def rounds_up_to(self, last_round: int) -> list[RoundRecord]:
        """The records of rounds 1..``last_round`` for a resumed run (written by the servers before
        this one). Lines of a round that the stopped server had not finished (it is redone), or cut
        short by the crash, are dropped from metrics.jsonl (rewritten atomically); a missing or
        unreadable round is a ResumeError."""
        lines = self.metrics_path.read_text().splitlines() if self.metrics_path.is_file() else []
        records, kept = [], []
        for number, line in enumerate(lines, start=1):
            try:
                record = RoundRecord.from_json(json.loads(line))
            except ValueError as error:
                if number == len(lines):
                    break  # the last line was being written when the server stopped
                raise ResumeError(f"{self.metrics_path}:{number}: not a round record ({error})") from error
            if record.round <= last_round:
                records.append(record)
                kept.append(line + "\n")
        found = [r.round for r in records]
        if found != list(range(1, last_round + 1)):
            raise ResumeError(f"{self.metrics_path} holds rounds {found}; the run state says rounds "
                              f"1..{last_round} completed")
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.metrics_path)
        return records

    def write_config(self, config: RunConfig) -> None:
        (self.path / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))

    def append_round(self, record: RoundRecord) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record.to_json()) + "\n")

    def checkpoint(self, round_number: int, state: Mapping[str, torch.Tensor], last: bool = False) -> Path | None:
        """Save the global model after ``round_number`` (0: the initial model) as the
        ``checkpoint`` settings say: the initial model and the ``last`` round always, other rounds
        every ``checkpoint.every``; then drop round checkpoints beyond the newest
        ``checkpoint.keep`` (never the initial model). Returns the file written, if any."""
        every, keep = self.checkpoints.every, self.checkpoints.keep
        if round_number and not last and (not every or round_number % every):
            return None
        directory = self.path / CHECKPOINTS
        path = directory / f"round_{round_number:04d}.safetensors"
        save_tensors(path, state)
        if keep:
            rounds = sorted((p for p in directory.glob("round_*.safetensors") if p.name != "round_0000.safetensors"),
                            key=lambda p: int(p.stem.removeprefix("round_")))
            for old in rounds[:-keep]:
                old.unlink()
        return path

    def write_summary(self, summary: RunSummary) -> None:
        tmp = self.path / "summary.json.tmp"
        tmp.write_text(json.dumps(summary.to_json(), indent=1))
        tmp.replace(self.path / "summary.json")


def _stats(values: list[float], weights: list[float]) -> ClientStats:
    """Mean and std over clients (unweighted) and the sample-weighted mean."""
    if not values:
        return ClientStats()
    total = sum(weights)
    return ClientStats(
        mean=statistics.fmean(values),
        std=statistics.pstdev(values) if len(values) > 1 else 0.0,
        weighted_mean=sum(v * w for v, w in zip(values, weights)) / total if total else None,
        clients=len(values),
    )


def _metric_summary(evaluations: Mapping[int, Mapping[str, float]], key: str) -> ClientStats:
    clients = sorted(c for c, m in evaluations.items() if key in m)
    return _stats([evaluations[c][key] for c in clients], [evaluations[c]["test_samples"] for c in clients])


def _reported_summary(evaluations: Mapping[int, Mapping[str, float]], key: str) -> ClientStats | None:
    """:func:`_metric_summary` where any client reported ``key`` (the head-less classifiers), else None."""
    return _metric_summary(evaluations, key) if any(key in m for m in evaluations.values()) else None


def build_summary(config: RunConfig, model: torch.nn.Module, rounds: Sequence[RoundRecord],
                  evaluations: Mapping[int, Mapping[str, float]], global_metrics: ModelMetrics | None,
                  ledger: ByteLedger, failures: list[str], seconds: float, status: str = COMPLETED,
                  note: str | None = None, evaluation_delivery: DeliveryCounts | None = None,
                  exit_code: int | None = None) -> RunSummary:
    """The run's summary.json. ``rounds``: the round records (a resumed run's earlier rounds
    included); ``evaluations``: each client's final evaluation report. ``status`` says how the run
    ended (:data:`COMPLETED`, :data:`INTERRUPTED`, :data:`FAILED`: then it holds what was known,
    ``note`` says why); ``evaluation_delivery``: what the final evaluation had to send again (the
    rounds' counts are in their records); ``exit_code``: the server's, where known."""
    names = dict(model.named_parameters())
    body = [n for n in names if n.startswith("body.")]
    head = [n for n in names if n.startswith("head.")]
    epochs = sorted(set(config.evaluate.finetune_epochs))
    metric = "acc" if any("initial_acc" in m for m in evaluations.values()) else "loss"
    accuracy = Accuracy(
        metric=metric,
        initial=_metric_summary(evaluations, f"initial_{metric}"),
        personalized={str(e): _metric_summary(evaluations, f"finetune_{e}_{metric}") for e in epochs},
        headless=_reported_summary(evaluations, "headless_acc"),
        headless_cosine=_reported_summary(evaluations, "headless_cosine_acc"),
        global_metrics=global_metrics,
    )
    per_client = []
    for client in range(config.clients):
        m = evaluations.get(client, {})
        per_client.append(ClientResult(
            id=client,
            train_samples=int(m["train_samples"]) if "train_samples" in m else None,
            test_samples=int(m["test_samples"]) if "test_samples" in m else None,
            initial=m.get(f"initial_{metric}"),
            personalized={str(e): m.get(f"finetune_{e}_{metric}") for e in epochs},
            bytes=ByteCounts.of(ledger.totals(client=client)),
        ))
    totals = ledger.totals()
    encodings = {direction: {name: EncodedBytes(wire=e["wire"], raw=e["raw"]) for name, e in by_encoding.items()}
                 for direction, by_encoding in ledger.encodings().items()}
    return RunSummary(
        status=status,
        note=note or None,
        rounds_completed=len(rounds),
        algorithm=config.algorithm.name,
        model=config.model.name,
        dataset=config.data.dataset,
        rounds=config.rounds,
        clients=config.clients,
        seeds=config.resolved_seeds(),
        parameters=Parameters(total=count_parameters(model), body=count_parameters(model, body),
                              head=count_parameters(model, head)),
        accuracy=accuracy,
        bytes=RunBytes(
            down=totals["down"], up=totals["up"], by_part=by_key(ledger.by_part()),
            per_round_mean=ByteCounts(down=_mean([r.bytes_down for r in rounds], 0),
                                      up=_mean([r.bytes_up for r in rounds], 0)),
            evaluation=ByteCounts.of(ledger.totals(config.rounds + 1)),
            refused_up=ledger.refused_bytes,
            encodings=encodings,
            compression_ratio=_compression_ratio(encodings),
            logical=_logical_bytes(rounds, ledger, config.rounds + 1)),
        compute=Compute(
            client_seconds=sum(r.client_compute_seconds for r in rounds),
            train_flops=sum(r.train_flops for r in rounds),
            round_seconds_mean=_mean([r.seconds for r in rounds], None),
            gpu_peak_bytes=max((peak for r in rounds for peak in (r.gpu_peak_bytes or {}).values()), default=None),
        ),
        delivery=RunDelivery(rounds=_delivery(rounds), evaluation=evaluation_delivery),
        robust=_robust(config, rounds, evaluations),
        privacy=_privacy(config, rounds) if config.privacy.dp.enabled else None,
        seconds=round(seconds, 3),
        failures=failures,
        per_client=per_client,
        exit_code=exit_code,
    )


def _robust(config: RunConfig, rounds: Sequence[RoundRecord],
            evaluations: Mapping[int, Mapping[str, float]]) -> RunRobust:
    """What the defences did over the run (docs/security.md): the rounds' counts summed, the
    clients whose evaluation sample counts were capped, and the clients the insider monitor named
    (an outlier in ``robust.monitor_rounds`` results in a row): their outlier results in all and the
    rounds in which they were named."""
    insiders: dict[str, NamedInsider] = {}
    for record in rounds:
        outliers = record.insiders.outliers if record.insiders is not None else None
        for client, outlier in (outliers or {}).items():
            entry = insiders.setdefault(client, NamedInsider())
            entry.outlier_results += 1
            if config.robust.monitor_rounds and outlier.streak >= config.robust.monitor_rounds:
                entry.named_in_rounds.append(record.round)
    return RunRobust(
        rounds=RobustCounts.total(r.robust for r in rounds if r.robust is not None),
        evaluation_samples_capped=sorted(c for c, m in evaluations.items()
                                         if any(reported(key) in m for key in SAMPLE_COUNTS)),
        insiders={client: entry for client, entry in sorted(insiders.items(), key=lambda item: int(item[0]))
                  if entry.named_in_rounds},
    )


def _mean(values: list[float], empty: float | None) -> float | None:
    """The mean of ``values``; ``empty`` where there are none."""
    return statistics.fmean(values) if values else empty


def _delivery(rounds: Sequence[RoundRecord]) -> DeliveryCounts | None:
    """The rounds' delivery counts summed; None where no record has them (records written before
    fedpart counted them, or no round)."""
    counted = [r.delivery for r in rounds if r.delivery is not None]
    return DeliveryCounts.total(counted) if counted else None


def _privacy(config: RunConfig, rounds: Sequence[RoundRecord]) -> RunPrivacy:
    """The DP budget spent (``privacy.dp``, docs/privacy.md): the epsilon reached (the last round
    record's; null where it is infinite, without noise), at which delta, the sampling and the
    dp-accounting accountant it was accounted for, and the mechanism's settings."""
    dp = config.privacy.dp
    return RunPrivacy(
        epsilon=rounds[-1].privacy.epsilon if rounds else 0.0,
        delta=dp.resolved_delta(config.clients),
        sampling=config.sampling.scheme,
        accountant=dp.accountant,
        noise_multiplier=dp.noise_multiplier,
        clip_norm=dp.clip_norm,
        target_epsilon=dp.target_epsilon,
        rounds=len(rounds),
    )


def _logical_bytes(rounds: Sequence[RoundRecord], ledger: ByteLedger, evaluation_round: int) -> LogicalBytes:
    """The run's logical bytes: its rounds' (summed from their records, so a resumed run counts
    the rounds an earlier server ran; records written before fedpart counted them have none)
    and the final evaluation's (from the ledger, as ``evaluation_round``)."""
    counted = [r.logical for r in rounds if r.logical is not None]
    units = [r.bytes_by_unit or {} for r in rounds if r.logical is not None]
    evaluation = ledger.logical(evaluation_round)
    by_part: dict[str, ByteCounts] = {}
    by_unit: dict[str, ByteCounts] = {}
    splits = [(by_part, logical.by_part) for logical in counted] + [(by_unit, split) for split in units]
    splits += [(by_part, by_key(evaluation["by_part"])), (by_unit, by_key(ledger.by_unit(evaluation_round)))]
    for totals, split in splits:
        for key, counts in split.items():
            totals[key] = totals.get(key, ByteCounts(down=0, up=0)) + counts
    return LogicalBytes(
        down=sum(logical.down for logical in counted) + evaluation["down"],
        up=sum(logical.up for logical in counted) + evaluation["up"],
        by_part=by_part,
        by_unit=by_unit,
        per_round_mean=ByteCounts(down=_mean([logical.down for logical in counted], 0),
                                  up=_mean([logical.up for logical in counted], 0)),
        evaluation=ByteCounts.of(evaluation),
    )


def _compression_ratio(encodings: Mapping[str, Mapping[str, EncodedBytes]]) -> dict[str, float | None]:
    """The compression ratio achieved per direction: decoded bytes / serialized tensor bytes over
    its encodings (None where no tensor moved)."""
    ratio = {}
    for direction, by_encoding in encodings.items():
        wire = sum(e.wire for e in by_encoding.values())
        ratio[direction] = sum(e.raw for e in by_encoding.values()) / wire if wire else None
    return ratio
