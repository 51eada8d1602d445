"""What the round engine records of the run (:class:`~fedpart.server.engine.coordinator.Coordinator`):
each round's line of ``metrics.jsonl`` (:class:`~fedpart.common.process.records.RoundRecord`) from what the
round collected (:class:`RoundResults`), the byte ledger and the task board (or, for a version of
the buffered engine, what :class:`VersionNotes` says), the virtual clock where the run has one, and
the durations of the rounds this server ran, from which the live display's ETA comes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from fedpart.common.ml.algorithms import learning_rate
from fedpart.common.config.run_config import TrainConfig
from fedpart.common.process.records import (
    BufferedVersion,
    BytesByPart,
    ByteCounts,
    RoundClient,
    DeliveryCounts,
    RoundRecord,
    by_key,
)
from fedpart.server.output.accounting import ByteLedger
from fedpart.server.policy.aggregate import RoundResults
from fedpart.server.policy.base import Policy
from fedpart.server.engine.task_board import TaskBoard
from fedpart.server.engine.virtual_clock import VirtualClock


class Traffic(Protocol):
    """Bytes of a round, as :class:`~fedpart.server.output.accounting.ByteLedger` answers them."""

    def totals(self, round_number: int | None = None, client: int | None = None) -> dict[str, int]: ...

    def by_part(self, round_number: int | None = None) -> dict[str, dict[str, int]]: ...

    def logical(self, round_number: int | None = None) -> dict: ...

    def logical_totals(self, round_number: int, client: int) -> dict[str, int]: ...

    def by_unit(self, round_number: int | None = None) -> dict[str, dict[str, int]]: ...


@dataclass
class VersionNotes:
    """What a server version of the buffered engine records beyond a round's: its bytes
    (``traffic``), what it had to send again, the virtual clock (time and device seconds of the
    tasks it folded; None on the wall clock) and the ``buffered`` section of its record."""

    traffic: Traffic
    delivery: DeliveryCounts
    virtual: tuple[float, float] | None
    buffered: BufferedVersion


class RunRecorder:
    """The records of the run's rounds and their durations (the round engine holds its lock
    while it calls :meth:`start_round`, :meth:`end_round` and :meth:`eta`)."""

    def __init__(self, rounds: int, train: TrainConfig, ledger: ByteLedger, board: TaskBoard, policy: Policy,
                 clock: VirtualClock | None = None) -> None:
        """The records of a run of ``rounds`` rounds whose learning rate follows ``train``."""
        self.rounds = rounds
        self.train = train
        self.ledger = ledger
        self.board = board
        self.policy = policy
        self.clock = clock
        self.completed_rounds = 0             # rounds completed in this run (a resumed one included)
        self.round_seconds: list[float] = []  # durations of the rounds this server ran (for the ETA)
        self.round_started = 0.0
        self.sampled = 0                      # clients sampled in the current round

    def start_round(self, started: float, sampled: int) -> None:
        self.round_started = started
        self.sampled = sampled

    def end_round(self, round_number: int, seconds: float) -> None:
        self.completed_rounds = round_number
        self.round_seconds.append(seconds)

    def training(self, round_number: int) -> bool:
        """Whether the run is in its rounds (past the joins) at round ``round_number``."""
        return round_number > self.completed_rounds or bool(self.round_seconds)

    def eta(self, running: bool) -> float | None:
        """Seconds left: the mean time of the rounds this server completed times the rounds left,
        less the current round's time so far (``running``); None before a round completed."""
        if not self.round_seconds:
            return None
        mean = sum(self.round_seconds) / len(self.round_seconds)
        elapsed = time.monotonic() - self.round_started if running else 0.0
        return max(0.0, mean * (self.rounds - self.completed_rounds) - elapsed)

    def record(self, round_number: int, sampled: list[int], completed: list[int], results: RoundResults,
               processes: Mapping[int, str], seconds: float, version: VersionNotes | None = None) -> RoundRecord:
        """The round's line of metrics.jsonl; ``processes`` names the process each client's task
        went to. A synchronous round moves the virtual clock (where the run has one) past its
        folded clients."""
        ledger = version.traffic if version is not None else self.ledger
        delivery = version.delivery if version is not None else self.board.delivery_counts(round_number)
        if version is not None:
            virtual = version.virtual
        else:
            virtual = self.clock.sync_round(round_number, completed) if self.clock is not None else None
        metrics = results.metrics
        samples = results.samples
        total = sum(samples.values())

        def weighted(key: str) -> float | None:
            keyed = [(metrics[c][key], samples[c]) for c in completed if key in metrics[c]]
            weight = sum(n for _, n in keyed)
            return sum(v * n for v, n in keyed) / weight if weight else None

        def summed(key: str) -> float:
            return sum(metrics[c].get(key, 0.0) for c in completed)

        totals = ledger.totals(round_number)
        logical = ledger.logical(round_number)
        gpu_peak: dict[str, int] = {}  # per client process: its highest peak over this round's tasks
        for c in completed:
            if "gpu_peak_bytes" in metrics[c]:
                gpu_peak[processes[c]] = max(gpu_peak.get(processes[c], 0), int(metrics[c]["gpu_peak_bytes"]))
        record = RoundRecord(
            round=round_number,
            sampled=sampled,
            completed=completed,
            train_loss=weighted("loss"),
            lr=learning_rate(self.train.lr, round_number - 1, self.rounds, self.train.lr_milestones,
                             self.train.lr_gamma),
            seconds=round(seconds, 4),
            train_samples=total,
            client_compute_seconds=summed("compute_seconds"),
            trainable_parameters=weighted("trainable_parameters"),
            train_flops=summed("train_flops"),
            bytes_down=totals["down"],
            bytes_up=totals["up"],
            bytes_by_part=by_key(ledger.by_part(round_number)),
            logical=BytesByPart(down=logical["down"], up=logical["up"], by_part=by_key(logical["by_part"])),
            bytes_by_unit=by_key(ledger.by_unit(round_number)),
            clients={str(c): self._client(ledger, round_number, c, metrics.get(c, {})) for c in sampled},
            robust=copy.deepcopy(results.robust),
            insiders=results.deltas.insiders,
            delivery=delivery,
            gpu_peak_bytes=gpu_peak or None,
            virtual_seconds=round(virtual[0], 6) if virtual is not None else None,
            virtual_busy=round(virtual[1], 6) if virtual is not None else None,
            buffered=version.buffered if version is not None else None,
        )
        self.policy.round_record(record)
        return record

    @staticmethod
    def _client(ledger: Traffic, round_number: int, client: int, metrics: Mapping[str, float]) -> RoundClient:
        """A sampled client's entry: its bytes of the round, physical and logical, and what its
        training reported (``metrics``; none where it completed no training): its compute seconds
        and, under ``privacy.dp_sgd``, its own epsilon over the rounds it trained, delta and steps."""
        physical = ByteCounts.of(ledger.totals(round_number, client))
        logical = ByteCounts.of(ledger.logical_totals(round_number, client))
        return RoundClient(down=physical.down, up=physical.up, logical_down=logical.down, logical_up=logical.up,
                           compute_seconds=metrics.get("compute_seconds"),
                           dp_sgd_epsilon=metrics.get("dp_sgd_epsilon"), dp_sgd_steps=metrics.get("dp_sgd_steps"),
                           dp_sgd_delta=metrics.get("dp_sgd_delta"))
