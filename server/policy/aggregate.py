"""What a round's results are folded into, shared by the policy's interface (:mod:`.base`),
its core and layers, and the round engines: a result as screening passed it (:class:`Screened`),
the round's aggregate (:class:`RoundAggregate`) and what the round has collected
(:class:`RoundResults`)."""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fedpart.common.process.records import Insiders, RoundRobust
from fedpart.server.policy.aggregation import Aggregator
from fedpart.server.policy.insiders import InsiderMonitor, Observation
from fedpart.server.policy.optimizers import RoundDelta
from fedpart.server.policy.privacy import ClippedDeltas
from fedpart.server.policy.robust import MeasuredDeltas, delta_norm, screening_norm, upload_key


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
    (:class:`~fedpart.server.policy.privacy.ClippedDeltas`); else ``measured``."""
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
    client's result (:class:`~fedpart.server.policy.insiders.Observation`). Otherwise ``add`` only hands
    the result to the combiner. ``delta`` is what the server optimizer saw of the round, once taken."""

    def __init__(self, combiner: Aggregator, record_norms: bool, round_number: int = 0) -> None:
        self.combiner = combiner
        self.record_norms = record_norms
        self.record_medians = False
        self.round_number = round_number
        self.monitor: InsiderMonitor | None = None
        self.insiders: Insiders | None = None  # the round record's entry, once the policy closed the round
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



@dataclass
class RoundResults:
    """What one round has collected so far."""

    deltas: RoundAggregate
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    robust: RoundRobust = field(default_factory=RoundRobust)
