"""The server's policy for a round's results, as the run configures it: screen each result,
combine the round's results, and step the global model (Flower's strategy, kept out of the round
loop in :mod:`fedpart.server.coordinator`).

Before a result is folded, :meth:`ServerPolicy.screen` caps its self-reported sample count (at the
client's partition size where the server can compute the seeded partition itself, and at
``robust.max_samples``) and bounds the L2 norm of its delta over all its delta tensors
(:mod:`fedpart.server.robust`: the adaptive bound by default, ``robust.norm_bound`` where set, to
clip or refuse). The round's results are combined by the configured aggregator into a
:class:`RoundAggregate`; the combined delta then goes through the run's server optimizer
(``fedpart.server.optimizers``): the ``server_optimizer`` section, or the step an objective term
brings (FedDyn's).

Under ``privacy.secure_aggregation`` the server sees no single delta: the adaptive bound is off,
each client clips its own update (``fedpart.server.secure_aggregation``), and the round's masked
updates are combined by :class:`~fedpart.server.secure_aggregation.SecureSum`.

With ``privacy.dp`` on (DP-FedAvg, ``fedpart.server.privacy``) the clip is the bound: screening
clips every delta to ``privacy.dp.clip_norm`` (a client that did not clip is clipped here, and a
lossy codec's rounding of a clipped delta too), the adaptive bound is off (it would let the other
clients' norms decide whether a result counts), every result weighs 1, and a round's deltas are
combined into their noised sum over the expected number of clients.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fedpart.common.config import RunConfig
from fedpart.common.experiment import build_run_model, run_algorithm
from fedpart.common.registry import ROBUST_AGGREGATORS
from fedpart.server.aggregation import Aggregator, HeadDictionary
from fedpart.server.optimizers import RoundDelta, ServerOptimizer, build_server_optimizer
from fedpart.server.privacy import DifferentialPrivacy
from fedpart.server.robust import (
    AdaptiveBound,
    MeasuredDeltas,
    ResultRefused,
    delta_norm,
    partition_train_sizes,
    scaled,
    screening_norm,
    upload_key,
)
from fedpart.server.run_state import ResumeError
from fedpart.server.secure_aggregation import SecureRound, SecureSum


@dataclass(frozen=True)
class Screened:
    """A result that passed screening: the deltas to fold, its counted samples and its weight."""

    deltas: dict[str, torch.Tensor]
    samples: int
    weight: float
    clipped: bool = False
    samples_capped: bool = False
    notes: tuple[str, ...] = ()  # what was changed, for the server log

class RoundAggregate:
    """A round's deltas: an :class:`Aggregator` that combines them, and each result's norm as it
    is folded, when the server optimizer asks for the norms (``record_norms``: FedExp) or the
    adaptive bound takes the round's median norms (``record_medians``). Otherwise ``add`` only
    hands the result to the combiner."""

    def __init__(self, combiner: Aggregator, record_norms: bool, record_medians: bool = False) -> None:
        self.combiner = combiner
        self.record_norms = record_norms
        self.record_medians = record_medians
        self._norms: list[tuple[float, float]] = []  # (weight, squared norm) per result
        self._by_upload: dict[str, list[float]] = {}  # upload key -> norms of the results that sent those tensors
        self._lock = threading.Lock()

    def add(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold one result's deltas in; ``tensors`` may be :class:`MeasuredDeltas` (norm known)."""
        squared = delta_norm(tensors) ** 2 if self.record_norms else 0.0
        if self.record_medians:
            norm = tensors.norm if isinstance(tensors, MeasuredDeltas) else screening_norm(tensors)
            key = upload_key(tensors)
        self.combiner.add(tensors, weight)
        if self.record_norms or self.record_medians:
            with self._lock:
                if self.record_norms:
                    self._norms.append((weight, squared))
                if self.record_medians:
                    self._by_upload.setdefault(key, []).append(norm)

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
        self.partition_sizes: list[int] | None = None
        if self.robust.partition_sizes:
            try:
                self.partition_sizes = partition_train_sizes(config)
            except (OSError, ValueError, ImportError) as error:
                cap = self.robust.max_samples or "none"
                log(f"warning: the server cannot compute the partition ({error}); reported sample counts "
                    f"are capped only by robust.max_samples ({cap})")

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
        return RoundAggregate(combiner, self.optimizer.needs_result_norms, self.adaptive_bound is not None)

    def combiner(self) -> Aggregator:
        """A fresh aggregator of the configured kind, its options read from the ``robust`` section."""
        component = ROBUST_AGGREGATORS[self.robust.aggregator]  # its options checked by the config's validation
        return component(**{option.name: option.take(getattr(self.robust, option.name), f"robust.{option.name}")
                            for option in component.options})

    def sample_cap(self, client_id: int) -> int | None:
        """The most training samples client ``client_id`` can have, if the server knows a bound."""
        caps = [self.partition_sizes[client_id]] if self.partition_sizes is not None else []
        if self.robust.max_samples:
            caps.append(self.robust.max_samples)
        return min(caps) if caps else None

    def screen(self, client_id: int, deltas: dict[str, torch.Tensor], num_samples: int) -> Screened:
        """Cap the reported sample count and bound the delta's norm; raises :class:`ResultRefused`
        (nothing changed) for a result the configuration refuses."""
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
            if adaptive is not None and norm > adaptive[0]:
                raise ResultRefused(f"delta norm {norm:.6g} exceeds {adaptive[1]}")
            if bound > 0 and norm > bound:
                if self.robust.norm_action == "reject":
                    raise ResultRefused(f"delta norm {norm:.6g} exceeds robust.norm_bound {bound:g}")
                deltas = scaled(deltas, bound / norm)
                clipped = True
                notes.append(f"delta norm {norm:.6g} exceeds robust.norm_bound {bound:g}; scaled down to it")
                norm = screening_norm(deltas)
            deltas = MeasuredDeltas(deltas, norm)
        weight = float(samples) if self.weighting == "samples" else 1.0
        return Screened(deltas, samples, weight, clipped, samples != num_samples, tuple(notes))

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
        updated = self.optimizer.step(global_state, deltas.round_delta())
        if self.adaptive_bound is not None:
            self.adaptive_bound.close_round(deltas.median_norms())
        if heads is not None and len(heads):
            combined = heads.combine(self.combiner())
            updated.update({name: value.to(global_state[name].dtype) for name, value in combined.items()})
        return updated

    def step_report(self) -> dict[str, float]:
        """What the server optimizer's last step chose (the round's ``server_step`` metrics)."""
        return self.optimizer.report()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The state the step carries from round to round, for the run state: the server
        optimizer's, the adaptive bound's medians (keys with :attr:`AdaptiveBound.STATE_PREFIX`)
        and the adaptive clip of ``privacy.dp`` (keys :attr:`DifferentialPrivacy.STATE_KEYS`)."""
        bound = self.adaptive_bound.state() if self.adaptive_bound is not None else {}
        privacy = self.privacy.state() if self.privacy is not None else {}
        return {**self.optimizer.state(), **bound, **privacy}

    def restore_optimizer(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue with the state of a saved run (:meth:`optimizer_state`): the adaptive bound
        goes on from the medians saved with it (none where no round had closed), adaptive clipping
        from the clip saved with it."""
        medians = {k: v for k, v in state.items() if k.startswith(AdaptiveBound.STATE_PREFIX)}
        clip = {k: v for k, v in state.items() if k in DifferentialPrivacy.STATE_KEYS}
        try:
            self.optimizer.load_state({k: v for k, v in state.items() if k not in medians and k not in clip})
            if self.adaptive_bound is not None:
                self.adaptive_bound.load_state(medians)
            if self.privacy is not None:
                self.privacy.load_state(clip)
        except ValueError as error:
            raise ResumeError(f"the saved server optimizer state does not fit the config: {error}") from error
