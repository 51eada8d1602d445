"""The core of the server's policy, with no defence and no privacy in it: a result counts for its
samples (``train.weighting``), the round's results are combined by the configured aggregator
(``robust.aggregator``: the streaming weighted mean by default), and the combined delta goes
through the run's server optimizer (:mod:`fedpart.server.optimizers`: the ``server_optimizer``
section, or the step an objective term brings, FedDyn's); FedHA's collected heads are combined by
the same kind of aggregator. The layers of :mod:`fedpart.server.policy` wrap it.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedpart.common.config import RunConfig
from fedpart.common.experiment import run_algorithm
from fedpart.common.registry import ROBUST_AGGREGATORS
from fedpart.server.aggregation import Aggregator, HeadDictionary
from fedpart.server.insiders import InsiderMonitor, Observation
from fedpart.server.optimizers import RoundDelta, ServerOptimizer, build_server_optimizer
from fedpart.server.policy.base import Policy, RoundSteps
from fedpart.server.privacy import ClippedDeltas
from fedpart.server.robust import MeasuredDeltas, delta_norm, screening_norm, upload_key


@dataclass(frozen=True)
class Screened:
    """A result that passed screening: the deltas to fold, its counted samples and its weight."""

    deltas: dict[str, torch.Tensor]
    samples: int
    weight: float
    clipped: bool = False
    samples_capped: bool = False
    notes: tuple[str, ...] = ()  # what was changed, for the server log


def _sent_norm(tensors: Mapping[str, torch.Tensor], measured: float) -> float:
    """The L2 norm of a result's deltas as the client sent them: before a clip to
    ``robust.norm_bound`` (:class:`MeasuredDeltas`) or ``privacy.dp.clip_norm``
    (:class:`~fedpart.server.privacy.ClippedDeltas`); else ``measured``."""
    if isinstance(tensors, MeasuredDeltas):
        return tensors.sent_norm
    if isinstance(tensors, ClippedDeltas):
        return tensors.norm
    return measured


class RoundAggregate:
    """A round's deltas: an :class:`Aggregator` that combines them (``combiner``: the core's, or the
    one a layer puts in its place), and each result's norm as it is folded, when the server
    optimizer asks for the norms (``record_norms``: FedExp) or a layer takes the round's median
    norms (``record_medians``: the adaptive bound), and what the insider ``monitor`` keeps of each
    client's result (:class:`~fedpart.server.insiders.Observation`). Otherwise ``add`` only hands
    the result to the combiner. ``delta`` is what the server optimizer saw of the round, once taken."""

    def __init__(self, combiner: Aggregator, record_norms: bool, round_number: int = 0) -> None:
        self.combiner = combiner
        self.record_norms = record_norms
        self.record_medians = False
        self.round_number = round_number
        self.monitor: InsiderMonitor | None = None
        self.insiders: dict | None = None  # the round record's entry, once the policy closed the round
        self.delta: RoundDelta | None = None
        self._norms: list[tuple[float, float]] = []  # (weight, squared norm) per result
        self._by_upload: dict[str, list[float]] = {}  # upload key -> norms of the results that sent those tensors
        self._folded: dict[int, Observation] = {}     # the monitor's observations by client
        self._refused: dict[int, Observation] = {}
        self._lock = threading.Lock()

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float, client: int | None = None) -> None:
        """Fold one result's deltas in; ``tensors`` may be :class:`MeasuredDeltas` (norm known).
        The monitor observes the result of ``client`` (none without a client)."""
        squared = delta_norm(tensors) ** 2 if self.record_norms else 0.0
        observed = self.monitor is not None and client is not None
        if self.record_medians or observed:
            norm = tensors.norm if isinstance(tensors, MeasuredDeltas) else screening_norm(tensors)
        key = upload_key(tensors) if self.record_medians else ""
        observation = self.monitor.observe(tensors, _sent_norm(tensors, norm)) if observed else None
        self.combiner.add(tensors, weight)
        with self._lock:
            if self.record_norms:
                self._norms.append((weight, squared))
            if self.record_medians:
                self._by_upload.setdefault(key, []).append(norm)
            if observation is not None:
                self._folded[client] = observation

    def refused(self, client: int, observation: Observation | None) -> None:
        """Screening refused ``client``'s result (over a norm bound, or its client is named): the
        monitor judges it with the round's others (``observation`` None: nothing to judge)."""
        if self.monitor is not None and observation is not None:
            with self._lock:
                self._refused[client] = observation

    def close(self) -> None:
        """Let the monitor judge the round's results (call after every ``add`` has returned)."""
        if self.monitor is not None:
            with self._lock:
                folded, refused = dict(self._folded), dict(self._refused)
            self.insiders = self.monitor.close_round(self.round_number, folded, refused)

    def median_norms(self) -> dict[str, float]:
        """The median delta norm of the round's results by upload key (call after every ``add``
        has returned; the same in any arrival order)."""
        with self._lock:
            return {key: statistics.median(norms) for key, norms in self._by_upload.items()}

    def result(self) -> dict[str, torch.Tensor]:
        return self.combiner.result()

    def counts(self) -> dict[str, int]:
        return self.combiner.counts()

    def round_delta(self) -> RoundDelta:
        """What the server optimizer sees of the round, taken once (call after every ``add`` has
        returned): a combiner's result may be costly, and a noised one must not be drawn twice."""
        if self.delta is None:
            second_moment = None
            if self.record_norms:
                with self._lock:  # exactly rounded sums: the same in any arrival order
                    total = math.fsum(weight for weight, _ in self._norms)
                    weighted = math.fsum(weight * squared for weight, squared in self._norms)
                second_moment = weighted / total if total else 0.0
            self.delta = RoundDelta(self.result(), self.counts(), second_moment)
        return self.delta


class Combine(Policy):
    """Counts each result for its samples, combines a round's results with the configured
    aggregator and moves the global model with the run's server optimizer."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__(None)
        self.robust = config.robust
        self.weighting = config.train.weighting
        section = config.server_optimizer
        self.optimizer: ServerOptimizer = build_server_optimizer(
            section.name, section.options, run_algorithm(config).server_step, config.clients)

    def combiner(self) -> Aggregator:
        """A fresh aggregator of the configured kind, its options read from the ``robust`` section."""
        component = ROBUST_AGGREGATORS[self.robust.aggregator]  # its options checked by the config's validation
        return component(**{option.name: option.take(getattr(self.robust, option.name), f"robust.{option.name}")
                            for option in component.options})

    def screen(self, client: int, deltas: dict[str, torch.Tensor], samples: int) -> Screened:
        return Screened(deltas, samples, float(samples) if self.weighting == "samples" else 1.0)

    def screen_evaluation(self, client: int, metrics: Mapping[str, float]) -> tuple[dict[str, float], tuple[str, ...]]:
        return dict(metrics), ()

    def relative_bounds(self) -> bool:
        return True

    def owns(self, task) -> bool:
        return False

    def accept(self, task, result, tensors, folding) -> None:
        raise ValueError(f"no layer of the policy takes the results of task {task.task_id}")

    def expected_uploads(self, task) -> None:
        return None

    def open_round(self, round_number: int, uploads: Mapping[str, torch.Tensor]) -> RoundAggregate:
        return RoundAggregate(self.combiner(), self.optimizer.needs_result_norms, round_number)

    def task_fields(self) -> dict[str, Any]:
        return {}

    def close_round(self, steps: RoundSteps) -> None:
        return None

    def counted(self, clients: Iterable[int]) -> set[int]:
        return set(clients)

    def new_global(self, global_state: Mapping[str, torch.Tensor], aggregate: RoundAggregate,
                   heads: HeadDictionary | None) -> dict[str, torch.Tensor]:
        """The server optimizer's step over the combined delta, and the collected heads (FedHA)
        combined by the same kind of aggregator when ``heads`` is given."""
        updated = self.optimizer.step(global_state, aggregate.round_delta())
        if heads is not None and len(heads):
            combined = heads.combine(self.combiner())
            updated.update({name: value.to(global_state[name].dtype) for name, value in combined.items()})
        return updated

    def sum_noise(self, round_number: int) -> None:
        return None

    def round_record(self, round_number: int) -> dict[str, Any]:
        return {"server_step": self.optimizer.report()}

    def last_round(self, rounds: int) -> int:
        return rounds

    def stop_note(self) -> None:
        return None

    def state(self) -> dict[str, torch.Tensor]:
        return self.optimizer.state()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.optimizer.load_state(state)
