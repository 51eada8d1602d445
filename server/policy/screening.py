"""Robust screening, a layer of the server's policy (the ``robust:`` section): what a single
result may weigh, and which results do not count.

- Sample counts, a training result's and an evaluation report's (the weights of the summary's
  weighted means), are capped at the client's partition split where the server can compute the
  seeded partition itself, and at ``robust.max_samples``; a capped evaluation count keeps what the
  client reported as ``reported_train_samples`` / ``reported_test_samples``.
- Norm bounds (:mod:`fedpart.server.policy.robust`): the adaptive bound by default, ``robust.norm_bound``
  where set, to clip or refuse.
- The insider monitor (:mod:`fedpart.server.policy.insiders`) judges each folded (and each refused)
  result by its norm and direction, names a client that is an outlier round after round, and with
  ``robust.monitor_action: refuse`` refuses its results until one is not.

Where another layer sees no single update, the bounds and the refusals step aside and the monitor
warns only: under DP-FedAvg (the clip is the bound, and whether a result counts must not depend on
the other clients' results, which the accounting does not cover) and under secure aggregation
(no single update at all: the monitor watches the revealed sum instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from fedpart.common.config.experiment import Experiment
from fedpart.common.config.run_config import RunConfig
from fedpart.common.process.console import Log
from fedpart.server.policy.aggregate import RoundAggregate, Screened
from fedpart.server.policy.aggregation import HeadDictionary
from fedpart.server.policy.base import Policy
from fedpart.server.policy.insiders import InsiderMonitor, Observation
from fedpart.server.policy.robust import (
    AdaptiveBound,
    MeasuredDeltas,
    PartitionSizes,
    ResultRefused,
    delta_norm,
    partition_sizes,
    scaled,
    screening_norm,
)
from fedpart.server.policy.validation import SAMPLE_COUNTS, reported


def applies(config: RunConfig) -> bool:
    """Always: the parts of the layer switch themselves off."""
    return True


def wrap(inner: Policy, config: RunConfig, log: Callable[[str], None], experiment: Experiment) -> Policy:
    """The screening layer around ``inner``."""
    return RobustScreening(inner, config, log, experiment.model.state_dict())


class RobustScreening(Policy):
    """Caps sample counts, bounds single results, watches for insiders (see the module)."""

    def __init__(self, inner: Policy, config: RunConfig, log: Callable[[str], None],
                 initial: Mapping[str, torch.Tensor]) -> None:
        """``initial``: the run's initial model tensors (the first round's adaptive bound scales
        with their norms)."""
        super().__init__(inner)
        self.robust = config.robust
        private, secure = config.privacy.dp.enabled, config.privacy.secure_aggregation
        self.single_results = not secure  # the server sees each result's update
        bounds = not private and not secure
        self.adaptive_bound: AdaptiveBound | None = None
        if self.robust.adaptive_bound and bounds:
            self.adaptive_bound = AdaptiveBound(self.robust.adaptive_bound, self.robust.first_round_bound, initial)
        self.norm_bound = self.robust.norm_bound if bounds else 0.0
        self.monitor: InsiderMonitor | None = None
        if self.robust.monitor_rounds:
            self.monitor = InsiderMonitor(config.clients, self.robust.monitor_norm_ratio, self.robust.monitor_cosine,
                                          self.robust.monitor_rounds, log)
        self.quarantine = self.monitor is not None and self.robust.monitor_action == "refuse" and bounds
        self.partition_sizes: PartitionSizes | None = None
        if self.robust.partition_sizes:
            try:
                self.partition_sizes = partition_sizes(config)
            except (OSError, ValueError, ImportError) as error:
                cap = self.robust.max_samples or "none"
                Log.of(log).warning(f"the server cannot compute the partition ({error}); reported sample counts "
                    f"(training results and evaluation reports) are capped only by robust.max_samples ({cap})")

    def sample_cap(self, client_id: int, split: str = "train") -> int | None:
        """The most samples of ``split`` (``train`` or ``test``) client ``client_id`` can have, if
        the server knows a bound: its partition's split and ``robust.max_samples``."""
        caps = [getattr(self.partition_sizes, split)[client_id]] if self.partition_sizes is not None else []
        if self.robust.max_samples:
            caps.append(self.robust.max_samples)
        return min(caps) if caps else None

    def screen_evaluation(self, client: int, metrics: Mapping[str, float]) -> tuple[dict[str, float], tuple[str, ...]]:
        counted, notes = self.inner.screen_evaluation(client, metrics)
        for split, key in zip(("train", "test"), SAMPLE_COUNTS):
            cap = self.sample_cap(client, split)
            if cap is not None and counted[key] > cap:
                notes += (f"its evaluation reported {counted[key]:.0f} {split} samples, more than the {cap} it can "
                          f"have; counted {cap}",)
                counted[reported(key)], counted[key] = counted[key], float(cap)
        return counted, notes

    def screen(self, client: int, deltas: dict[str, torch.Tensor], num_samples: int) -> Screened:
        """Cap the reported sample count and bound the delta's norm; raises :class:`ResultRefused`
        (nothing changed) for a result refused: over a norm bound, or of a client the insider
        monitor names (``robust.monitor_action: refuse``)."""
        notes = []
        samples = num_samples
        cap = self.sample_cap(client)
        if cap is not None and num_samples > cap:
            if cap == 0:
                raise ResultRefused(f"reported {num_samples} training samples; client {client} has none")
            samples = cap
            notes.append(f"reported {num_samples} training samples, more than the {cap} it can have; counted {cap}")
        clipped = False
        adaptive = self.adaptive_bound.limit(deltas) if self.adaptive_bound is not None and deltas else None
        bound = self.norm_bound if deltas else 0.0
        if adaptive is not None or bound > 0:
            norm = screening_norm(deltas)
            if not math.isfinite(norm):
                raise ResultRefused(f"delta norm {norm} overflows float64")
            sent = norm
            if adaptive is not None and norm > adaptive[0]:
                raise ResultRefused(f"delta norm {norm:.6g} exceeds {adaptive[1]}", self._observe(deltas, norm))
            if bound > 0 and norm > bound:
                if self.robust.norm_action == "reject":
                    raise ResultRefused(f"delta norm {norm:.6g} exceeds robust.norm_bound {bound:g}",
                                        self._observe(deltas, norm))
                deltas = scaled(deltas, bound / norm)
                clipped = True
                notes.append(f"delta norm {norm:.6g} exceeds robust.norm_bound {bound:g}; scaled down to it")
                norm = screening_norm(deltas)
            deltas = MeasuredDeltas(deltas, norm, sent)
        if self.quarantine and deltas and (named := self.monitor.named(client)):
            norm = deltas.sent_norm if isinstance(deltas, MeasuredDeltas) else screening_norm(deltas)
            raise ResultRefused(f"client {client} is named by the insider monitor: its last {named} results were "
                                "outliers; its results are refused until one is not (robust.monitor_action refuse)",
                                self._observe(deltas, norm) if math.isfinite(norm) else None)
        screened = self.inner.screen(client, deltas, samples)
        return replace(screened, clipped=clipped or screened.clipped, samples_capped=samples != num_samples,
                       notes=tuple(notes) + screened.notes)

    def _observe(self, deltas: Mapping[str, torch.Tensor], norm: float) -> Observation | None:
        """What the insider monitor keeps of a result screening refuses (None: no monitor)."""
        return self.monitor.observe(deltas, norm) if self.monitor is not None else None

    def open_round(self, round_number: int, uploads: Mapping[str, torch.Tensor]) -> RoundAggregate:
        aggregate = self.inner.open_round(round_number, uploads)
        aggregate.record_medians = self.adaptive_bound is not None
        aggregate.monitor = self.monitor if self.single_results else None
        return aggregate

    def new_global(self, global_state: Mapping[str, torch.Tensor], aggregate: RoundAggregate,
                   heads: HeadDictionary | None) -> dict[str, torch.Tensor]:
        """The inner policy's step; then the adaptive bound takes the round's median norms and the
        monitor judges the round (under secure aggregation: its revealed sum)."""
        updated = self.inner.new_global(global_state, aggregate, heads)
        if self.adaptive_bound is not None:
            self.adaptive_bound.close_round(aggregate.median_norms())
        if self.monitor is not None and not self.single_results:
            aggregate.insiders = self.monitor.close_sum(aggregate.round_number, delta_norm(aggregate.round_delta().mean))
        aggregate.close()
        return updated

    def state(self) -> dict[str, torch.Tensor]:
        """The inner state, the adaptive bound's medians (keys with
        :attr:`AdaptiveBound.STATE_PREFIX`) and the insider monitor's history (keys with
        :attr:`InsiderMonitor.STATE_PREFIX`)."""
        bound = self.adaptive_bound.state() if self.adaptive_bound is not None else {}
        monitor = self.monitor.state() if self.monitor is not None else {}
        return {**self.inner.state(), **bound, **monitor}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue with :meth:`state`: the adaptive bound from the medians saved with it (none
        where no round had closed), the insider monitor from its history."""
        medians = {k: v for k, v in state.items() if k.startswith(AdaptiveBound.STATE_PREFIX)}
        history = {k: v for k, v in state.items() if k.startswith(InsiderMonitor.STATE_PREFIX)}
        self.inner.load_state({k: v for k, v in state.items() if k not in medians and k not in history})
        if self.adaptive_bound is not None:
            self.adaptive_bound.load_state(medians)
        if self.monitor is not None:
            self.monitor.load_state(history)
