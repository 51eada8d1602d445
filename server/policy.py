"""The server's policy for a round's results, as the run configures it: screen each result,
combine the round's results, and step the global model (Flower's strategy, kept out of the round
loop in :mod:`fedpart.server.coordinator`).

Before a result is folded, :meth:`ServerPolicy.screen` caps its self-reported sample count (at the
client's partition size where the server can compute the seeded partition itself, and at
``robust.max_samples``), bounds the L2 norm of its delta over all its delta tensors
(:mod:`fedpart.server.robust`: the adaptive bound by default, ``robust.norm_bound`` where set, to
clip or refuse), and refuses the results of a client the insider monitor names
(:mod:`fedpart.server.insiders`, ``robust.monitor_action: refuse``). The round's results are
combined by the configured aggregator into a :class:`RoundAggregate`, which also keeps what the
monitor judges the round by; the combined delta then goes through the run's server optimizer
(``fedpart.server.optimizers``): the ``server_optimizer`` section, or the step an objective term
brings (FedDyn's). An evaluation report's sample counts are capped like a training result's
(:meth:`ServerPolicy.screen_evaluation`).

Under ``privacy.secure_aggregation`` the server sees no single delta: the adaptive bound and the
quarantine are off, each client clips its own update (``fedpart.server.secure_aggregation``), the
round's masked updates are combined by :class:`~fedpart.server.secure_aggregation.SecureSum`, and
the monitor watches the revealed sum.

With ``privacy.dp`` on (DP-FedAvg, ``fedpart.server.privacy``) the clip is the bound: screening
clips every delta to ``privacy.dp.clip_norm`` (a client that did not clip is clipped here, and a
lossy codec's rounding of a clipped delta too), the adaptive bound and the quarantine are off (they
would let the other clients' results decide whether a result counts; the monitor only warns), every
result weighs 1, and a round's deltas are combined into their noised sum over the expected number
of clients.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fedpart.common.config import RunConfig, robust_aggregator_options
from fedpart.common.experiment import build_run_model, run_algorithm
from fedpart.common.registry import ROBUST_AGGREGATORS
from fedpart.server.aggregation import Aggregator, HeadDictionary
from fedpart.server.optimizers import RoundDelta, ServerOptimizer, build_server_optimizer
from fedpart.server.insiders import InsiderMonitor, Observation
from fedpart.server.privacy import ClippedDeltas, DifferentialPrivacy
from fedpart.server.robust import (
    AdaptiveBound,
    MeasuredDeltas,
    ResultRefused,
    delta_norm,
    PartitionSizes,
    partition_sizes,
    scaled,
    screening_norm,
    upload_key,
)
from fedpart.server.run_state import ResumeError
from fedpart.server.secure_aggregation import SecureRound, SecureSum
from fedpart.server.validation import SAMPLE_COUNTS, reported


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
    """A round's deltas: an :class:`Aggregator` that combines them, and each result's norm as it
    is folded, when the server optimizer asks for the norms (``record_norms``: FedExp) or the
    adaptive bound takes the round's median norms (``record_medians``), and what the insider
    ``monitor`` keeps of each client's result (:class:`~fedpart.server.insiders.Observation`).
    Otherwise ``add`` only hands the result to the combiner."""

    def __init__(self, combiner: Aggregator, record_norms: bool, record_medians: bool = False,
                 round_number: int = 0, monitor: InsiderMonitor | None = None) -> None:
        self.combiner = combiner
        self.record_norms = record_norms
        self.record_medians = record_medians
        self.round_number = round_number
        self.monitor = monitor
        self.insiders: dict | None = None  # the round record's entry, once the policy closed the round
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
        """What the server optimizer sees of the round (call after every ``add`` has returned)."""
        second_moment = None
        if self.record_norms:
            with self._lock:  # exactly rounded sums: the same in any arrival order
                total = math.fsum(weight for weight, _ in self._norms)
                weighted = math.fsum(weight * squared for weight, squared in self._norms)
            second_moment = weighted / total if total else 0.0
        return RoundDelta(self.result(), self.counts(), second_moment)

class ServerPolicy:
    """Screens each result and combines a round's results, as ``config.robust`` says, and moves
    the global model with the run's server optimizer."""

    def __init__(self, config: RunConfig, log: Callable[[str], None] = print) -> None:
        self.robust = config.robust
        self.weighting = config.train.weighting
        section = config.server_optimizer
        self.optimizer: ServerOptimizer = build_server_optimizer(
            section.name, section.options, run_algorithm(config).server_step, config.clients)
        self.privacy: DifferentialPrivacy | None = None
        if config.privacy.dp.enabled:
            self.privacy = DifferentialPrivacy(config, log)
        self.adaptive_bound: AdaptiveBound | None = None
        if self.robust.adaptive_bound and self.privacy is None and not config.privacy.secure_aggregation:
            initial = build_run_model(config).state_dict()
            self.adaptive_bound = AdaptiveBound(self.robust.adaptive_bound, self.robust.first_round_bound, initial)
        self.secure = config.privacy.secure_aggregation
        self.monitor: InsiderMonitor | None = None
        if self.robust.monitor_rounds:
            self.monitor = InsiderMonitor(config.clients, self.robust.monitor_norm_ratio, self.robust.monitor_cosine,
                                          self.robust.monitor_rounds, log)
        # a client the monitor names is refused: not under secure aggregation (no single result to refuse), nor
        # under privacy.dp (whether a result counts would depend on the other clients' results)
        self.quarantine = (self.monitor is not None and self.robust.monitor_action == "refuse"
                           and self.privacy is None and not self.secure)
        self.partition_sizes: PartitionSizes | None = None
        if self.robust.partition_sizes:
            try:
                self.partition_sizes = partition_sizes(config)
            except (OSError, ValueError, ImportError) as error:
                cap = self.robust.max_samples or "none"
                log(f"warning: the server cannot compute the partition ({error}); reported sample counts "
                    f"(training results and evaluation reports) are capped only by robust.max_samples ({cap})")

    def new_aggregator(self, round_number: int = 0, uploads: Mapping[str, torch.Tensor] | None = None,
                       secure: SecureRound | None = None) -> RoundAggregate:
        """A fresh aggregator of a round's deltas: of the configured kind, or under ``privacy.dp``
        the noised sum of round ``round_number`` over the tensors ``uploads`` (the global tensors
        the round's plan uploads deltas of, by name; required then), or under secure aggregation
        the modular sum of the masked updates of ``secure``'s round (noised under ``privacy.dp``)."""
        if secure is not None:
            noise = None if self.privacy is None else self.privacy.noise(round_number)
            combiner = SecureSum(secure, noise)
        elif self.privacy is None:
            combiner = self.combiner()
        elif uploads is None:
            raise ValueError("privacy.dp: the noised sum needs the tensors the round uploads")
        else:
            combiner = self.privacy.aggregator(round_number, uploads)
        return RoundAggregate(combiner, self.optimizer.needs_result_norms, self.adaptive_bound is not None,
                              round_number, self.monitor if secure is None else None)

    def combiner(self) -> Aggregator:
        """A fresh aggregator of the configured kind, its options read from the ``robust`` section."""
        return ROBUST_AGGREGATORS[self.robust.aggregator](**robust_aggregator_options(self.robust))

    def sample_cap(self, client_id: int, split: str = "train") -> int | None:
        """The most samples of ``split`` (``train`` or ``test``) client ``client_id`` can have, if
        the server knows a bound: its partition's split and ``robust.max_samples``."""
        caps = [getattr(self.partition_sizes, split)[client_id]] if self.partition_sizes is not None else []
        if self.robust.max_samples:
            caps.append(self.robust.max_samples)
        return min(caps) if caps else None

    def screen_evaluation(self, client_id: int,
                          metrics: Mapping[str, float]) -> tuple[dict[str, float], tuple[str, ...]]:
        """An evaluation report's sample counts, the weights of the summary's weighted means,
        capped like a training result's (:meth:`sample_cap`). A capped count keeps what the client
        reported as ``reported_train_samples`` / ``reported_test_samples``. Returns the report as
        counted and what was changed, for the server log."""
        counted = dict(metrics)
        notes = []
        for split, key in zip(("train", "test"), SAMPLE_COUNTS):
            cap = self.sample_cap(client_id, split)
            if cap is not None and counted[key] > cap:
                notes.append(f"its evaluation reported {counted[key]:.0f} {split} samples, more than the {cap} it "
                             f"can have; counted {cap}")
                counted[reported(key)], counted[key] = counted[key], float(cap)
        return counted, tuple(notes)

    def screen(self, client_id: int, deltas: dict[str, torch.Tensor], num_samples: int) -> Screened:
        """Cap the reported sample count and bound the delta's norm; raises :class:`ResultRefused`
        (nothing changed) for a result the configuration refuses: over a norm bound, or of a client
        the insider monitor names (``robust.monitor_action: refuse``)."""
        notes = []
        samples = num_samples
        cap = self.sample_cap(client_id)
        if cap is not None and num_samples > cap:
            if cap == 0:
                raise ResultRefused(f"reported {num_samples} training samples; client {client_id} has none")
            samples = cap
            notes.append(f"reported {num_samples} training samples, more than the {cap} it can have; counted {cap}")
        if self.privacy is not None:
            return self._screen_private(deltas, samples, tuple(notes), samples != num_samples)
        clipped = False
        adaptive = self.adaptive_bound.limit(deltas) if self.adaptive_bound is not None and deltas else None
        bound = self.robust.norm_bound if deltas else 0.0
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
        if self.quarantine and deltas and (named := self.monitor.named(client_id)):
            norm = deltas.sent_norm if isinstance(deltas, MeasuredDeltas) else screening_norm(deltas)
            raise ResultRefused(f"client {client_id} is named by the insider monitor: its last {named} results were "
                                "outliers; its results are refused until one is not (robust.monitor_action refuse)",
                                self._observe(deltas, norm) if math.isfinite(norm) else None)
        weight = float(samples) if self.weighting == "samples" else 1.0
        return Screened(deltas, samples, weight, clipped, samples != num_samples, tuple(notes))

    def _observe(self, deltas: Mapping[str, torch.Tensor], norm: float) -> Observation | None:
        """What the insider monitor keeps of a result screening refuses (None: no monitor)."""
        return self.monitor.observe(deltas, norm) if self.monitor is not None else None

    def _screen_private(self, deltas: dict[str, torch.Tensor], samples: int, notes: tuple[str, ...],
                        samples_capped: bool) -> Screened:
        """Screening under ``privacy.dp``: the deltas clipped to the clip norm (counted as clipped
        where the result was over it by more than a codec's rounding; under adaptive clipping, over
        the round's clip at all), weight 1. The clipped deltas keep their norm before clipping
        (:class:`~fedpart.server.privacy.ClippedDeltas`), which adaptive clipping counts when they are folded."""
        if not deltas:
            return Screened(deltas, samples, 1.0, False, samples_capped, notes)
        try:
            clipped, note = self.privacy.clip(deltas)
        except ValueError as error:
            raise ResultRefused(str(error)) from error
        was_clipped = note is not None or (self.privacy.adaptive is not None and not clipped.unclipped)
        return Screened(clipped, samples, 1.0, was_clipped, samples_capped, notes + ((note,) if note else ()))

    def new_global(self, global_state: Mapping[str, torch.Tensor], deltas: RoundAggregate,
                   heads: HeadDictionary | None) -> dict[str, torch.Tensor]:
        """The updated global tensors: the server optimizer's step over the combined delta, and
        the collected heads (FedHA) combined by the same kind of aggregator when ``heads`` is given."""
        combined = deltas.round_delta()
        updated = self.optimizer.step(global_state, combined)
        if self.adaptive_bound is not None:
            self.adaptive_bound.close_round(deltas.median_norms())
        if self.monitor is not None and self.secure:
            deltas.insiders = self.monitor.close_sum(deltas.round_number, delta_norm(combined.mean))
        deltas.close()
        if heads is not None and len(heads):
            combined = heads.combine(self.combiner())
            updated.update({name: value.to(global_state[name].dtype) for name, value in combined.items()})
        return updated

    def step_report(self) -> dict[str, float]:
        """What the server optimizer's last step chose (the round's ``server_step`` metrics)."""
        return self.optimizer.report()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The state the step carries from round to round, for the run state: the server
        optimizer's, the adaptive bound's medians (keys with :attr:`AdaptiveBound.STATE_PREFIX`),
        the adaptive clip of ``privacy.dp`` (keys :attr:`DifferentialPrivacy.STATE_KEYS`) and the
        insider monitor's history (keys with :attr:`InsiderMonitor.STATE_PREFIX`)."""
        bound = self.adaptive_bound.state() if self.adaptive_bound is not None else {}
        privacy = self.privacy.state() if self.privacy is not None else {}
        monitor = self.monitor.state() if self.monitor is not None else {}
        return {**self.optimizer.state(), **bound, **privacy, **monitor}

    def restore_optimizer(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue with the state of a saved run (:meth:`optimizer_state`): the adaptive bound
        goes on from the medians saved with it (none where no round had closed), adaptive clipping
        from the clip saved with it, the insider monitor from its history."""
        medians = {k: v for k, v in state.items() if k.startswith(AdaptiveBound.STATE_PREFIX)}
        clip = {k: v for k, v in state.items() if k in DifferentialPrivacy.STATE_KEYS}
        history = {k: v for k, v in state.items() if k.startswith(InsiderMonitor.STATE_PREFIX)}
        try:
            self.optimizer.load_state({k: v for k, v in state.items()
                                       if k not in medians and k not in clip and k not in history})
            if self.adaptive_bound is not None:
                self.adaptive_bound.load_state(medians)
            if self.privacy is not None:
                self.privacy.load_state(clip)
            if self.monitor is not None:
                self.monitor.load_state(history)
        except ValueError as error:
            raise ResumeError(f"the saved server optimizer state does not fit the config: {error}") from error
