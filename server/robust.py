"""The aggregation step as the run configures it (the ``robust:`` section).

A result is never trusted for more than its shape (docs/architecture.md, Trust). Before a result is folded,
:meth:`AggregationStep.screen` caps its self-reported sample count (at the client's partition size
where the server can compute the seeded partition itself, and at ``robust.max_samples``) and
bounds the L2 norm of its delta over all its delta tensors: by default the :class:`AdaptiveBound`
refuses a delta more than ``robust.adaptive_bound`` times the median norm of the latest round's
deltas of the same tensors, and ``robust.norm_bound``, where the run sets one, clips a delta down
to it (``clip``) or refuses the result (``reject``). The round's results are combined by the
configured aggregator: the streaming weighted mean (default), or the coordinate-wise median or
trimmed mean of Yin et al., ICML 2018. Norm clipping of client updates as a defence: Sun et al.,
"Can You Really Backdoor Federated Learning?", 2019. The combined delta then goes through the
run's server optimizer (``fedpart.server.optimizers``): the ``server_optimizer`` section, or the
step an objective term brings (FedDyn's).

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

import hashlib
import math
import statistics
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from fedpart.common.config import RunConfig
from fedpart.common.data.datasets import load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.experiment import build_run_model, run_algorithm
from fedpart.common.registry import ROBUST_AGGREGATORS, Option
from fedpart.server.aggregation import (
    Aggregator,
    CoordinateMedian,
    CoordinateTrimmedMean,
    HeadDictionary,
    WeightedMean,
)
from fedpart.server.optimizers import RoundDelta, ServerOptimizer, build_server_optimizer
from fedpart.server.privacy import DifferentialPrivacy
from fedpart.server.run_state import ResumeError
from fedpart.server.secure_aggregation import SecureRound, SecureSum


class ResultRefused(ValueError):
    """A result the aggregation step will not fold in; the message says why."""


@dataclass
class RobustCounts:
    """What the defences did in one round (the ``robust`` entry of the round's metrics)."""

    clipped: int = 0
    rejected: int = 0
    samples_capped: int = 0
    non_finite: list[str] = field(default_factory=list)  # aggregated tensors refused, old value kept

    def as_dict(self) -> dict[str, int | list[str]]:
        return {"clipped": self.clipped, "rejected": self.rejected, "samples_capped": self.samples_capped,
                "non_finite": list(self.non_finite)}


@dataclass(frozen=True)
class Screened:
    """A result that passed screening: the deltas to fold, its counted samples and its weight."""

    deltas: dict[str, torch.Tensor]
    samples: int
    weight: float
    clipped: bool = False
    samples_capped: bool = False
    notes: tuple[str, ...] = ()  # what was changed, for the server log


def delta_norm(deltas: Mapping[str, torch.Tensor]) -> float:
    """L2 norm over all tensors of ``deltas`` together, accumulated in float64 (a floating-point
    tensor is read as it is, with no float64 copy of it)."""
    return math.hypot(*(float(torch.linalg.vector_norm(t if t.is_floating_point() else t.double(),
                                                       dtype=torch.float64)) for t in deltas.values()))


# A float32 norm at least this large lost at most about 1e-15 to elements whose squares
# underflowed (below 1.1e-19 each, in tensors of up to 1e8 elements): negligible beside it.
_FLOAT32_SAFE_NORM = 1e-10


def screening_norm(deltas: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of ``deltas`` as screening measures it, on the server's hot path: a float32
    tensor's norm accumulated in float32 (0.08 ms for a cnn2 result, against 0.23 ms for
    :func:`delta_norm`, within a few float32 roundings of it), measured again in float64 where
    that overflowed or is so small that squares may have underflowed; other tensors in float64."""
    norms = []
    for tensor in deltas.values():
        if tensor.dtype == torch.float32:
            norm = float(torch.linalg.vector_norm(tensor))
            if math.isfinite(norm) and norm >= _FLOAT32_SAFE_NORM:
                norms.append(norm)
                continue
        norms.append(delta_norm({"": tensor}))
    return math.hypot(*norms)


def upload_key(names: Iterable[str]) -> str:
    """A short name of a set of delta tensors that is the same in every process and every run
    (the first 16 hex digits of the SHA-256 of the sorted names)."""
    return hashlib.sha256("\0".join(sorted(names)).encode()).hexdigest()[:16]


class MeasuredDeltas(dict[str, torch.Tensor]):
    """A result's delta tensors with their L2 norm as screening measured it
    (:func:`screening_norm`), so that folding them does not measure them again."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], norm: float) -> None:
        super().__init__(tensors)
        self.norm = norm


def scaled(deltas: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``scale * deltas``, multiplied in float64 (a scale below float32's normal range, as for a
    delta of 1e30 in every element, is not rounded) and returned in each tensor's dtype."""
    return {name: (tensor.to(torch.float64) * scale).to(tensor.dtype) for name, tensor in deltas.items()}


class AdaptiveBound:
    """The default bound on a result's delta, which adapts to the run: a delta whose L2 norm
    exceeds ``factor`` times the median delta norm of the latest round that folded deltas of the
    same tensors is refused (a round's schedule decides which tensors train, so rounds that train
    different parts are not compared). Before such a round the bound is ``first_factor`` times the
    norm of those tensors in the initial global model (of the whole initial model where those are
    all zero; none where it is all zero).

    A delta that far out is refused, not clipped: clipped to the bound, one attacker in ten would
    still weigh as much as the honest clients together, every round (in the quickstart run of
    tests/test_robust.py, a 1e6-times delta clipped to 10 x the median took global accuracy from
    82 % to 16 %; refused, the run is the one without the attacker's results).

    The bound applied in a round is a function of earlier rounds only, and a median does not
    depend on the order in which results arrived: the run stays reproducible. The medians are of
    the folded results only (never of one screening refused), so one client moves a median by at
    most one rank. They go into the run state (:meth:`state`), so a resumed server applies the
    same bounds.
    """

    STATE_PREFIX = "robust.median_norm/"  # keys of the medians in the run state, after the upload key

    def __init__(self, factor: float, first_factor: float, initial: Mapping[str, torch.Tensor]) -> None:
        if not factor >= 1:
            raise ValueError(f"the adaptive bound's factor must be >= 1, got {factor}")
        self.factor = factor
        self.first_factor = first_factor
        self._initial_norms = {name: float(torch.linalg.vector_norm(tensor.to(torch.float64)))
                               for name, tensor in initial.items()}
        self._medians: dict[str, float] = {}  # upload key -> median delta norm of its latest round
        self._lock = threading.Lock()

    def limit(self, names: Iterable[str]) -> tuple[float, str] | None:
        """The largest delta norm of the tensors ``names`` that is not refused, and how it was set
        (for the refusal); None where there is no bound (no earlier round and no first-round bound)."""
        names = list(names)
        with self._lock:
            median = self._medians.get(upload_key(names))
        if median is not None:
            limit = self.factor * median
            return limit, (f"{limit:.6g}, robust.adaptive_bound {self.factor:g} x the median delta norm "
                           f"{median:.6g} of the latest round's results")
        if not self.first_factor:
            return None
        initial = self.initial_norm(names)
        if not initial:
            return None
        limit = self.first_factor * initial
        return limit, (f"{limit:.6g}, robust.first_round_bound {self.first_factor:g} x the initial global norm "
                       f"{initial:.6g} of these tensors")

    def initial_norm(self, names: Iterable[str]) -> float:
        """The L2 norm of the tensors ``names`` in the initial global model (of the whole initial
        model where those are all zero)."""
        names = list(names)
        unknown = sorted(set(names) - set(self._initial_norms))
        if unknown:
            raise ValueError(f"deltas of tensors the global model does not have: {unknown[:3]}")
        return math.hypot(*(self._initial_norms[name] for name in names)) or math.hypot(*self._initial_norms.values())

    def close_round(self, medians: Mapping[str, float]) -> None:
        """Take the median delta norms of a completed round, by upload key. A median of 0 (a round
        whose deltas were mostly zero) is not kept: it would refuse every later delta but zero."""
        with self._lock:
            self._medians.update({key: median for key, median in medians.items() if median > 0})

    def state(self) -> dict[str, torch.Tensor]:
        """The latest medians, for the run state (one float64 scalar each, keys with
        :attr:`STATE_PREFIX`)."""
        with self._lock:
            return {self.STATE_PREFIX + key: torch.tensor(median, dtype=torch.float64)
                    for key, median in sorted(self._medians.items())}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue with the medians :meth:`state` returned (keys with :attr:`STATE_PREFIX`)."""
        medians = {}
        for key, value in state.items():
            if value.numel() != 1 or not math.isfinite(median := float(value)) or median <= 0:
                raise ValueError(f"{key}: a median delta norm must be one positive finite number")
            medians[key[len(self.STATE_PREFIX):]] = median
        with self._lock:
            self._medians = medians


def partition_train_sizes(config: RunConfig) -> list[int]:
    """Every client's train-split size, from the same seeded partition the clients compute.

    Raises ``OSError``/``ValueError``/``ImportError`` when the server cannot load the dataset.
    """
    data = config.data
    dataset = load_dataset(data.dataset, data.root, **data.options)
    splits = make_partition(dataset.y_train, dataset.y_test, config.clients, data.partition.scheme, config.partition_seed,
                            num_classes=dataset.num_classes, **data.partition.options)
    return [len(split.train) for split in splits]


class RoundDeltas:
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


ROBUST_AGGREGATORS.register("mean", "The streaming weighted mean (train.weighting), folded as results arrive.")(
    WeightedMean)
ROBUST_AGGREGATORS.register("median", "The coordinate-wise median of the round's deltas (Yin et al., ICML 2018).")(
    CoordinateMedian)
ROBUST_AGGREGATORS.register(
    "trimmed_mean", "The coordinate-wise mean without the largest and smallest values (Yin et al., ICML 2018).",
    Option("trim_fraction", float, "robust.trim_fraction: share cut at each end of every coordinate",
           lambda value: 0 <= value < 0.5, "must be in [0, 0.5)"))(CoordinateTrimmedMean)


class AggregationStep:
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
                       secure: SecureRound | None = None) -> RoundDeltas:
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
        return RoundDeltas(combiner, self.optimizer.needs_result_norms, self.adaptive_bound is not None)

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

    def new_global(self, global_state: Mapping[str, torch.Tensor], deltas: RoundDeltas,
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
