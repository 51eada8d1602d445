"""Defences of the aggregation against what a result may carry (the ``robust:`` section).

A result is never trusted for more than its shape (docs/architecture.md, Trust). The pieces the
server's screening (:mod:`fedpart.server.policy.screening`) uses: the norm of a delta
over all its tensors (:func:`screening_norm`), the :class:`AdaptiveBound` that refuses a delta
more than ``robust.adaptive_bound`` times the median norm of the latest round's deltas of the same
tensors, scaling down to ``robust.norm_bound`` (Sun et al., "Can You Really Backdoor Federated
Learning?", 2019), the partition sizes that cap a self-reported sample count (of a training result
or an evaluation report), and the robust
aggregators: the streaming weighted mean (default), the coordinate-wise median and trimmed mean of
Yin et al., ICML 2018.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from fedpart.common.config.run_config import RunConfig
from fedpart.common.data.datasets import load_dataset
from fedpart.common.data.partition import make_partition
from fedpart.common.components.registry import ROBUST_AGGREGATORS
from fedpart.server.policy.aggregation import CoordinateMedian, CoordinateTrimmedMean, WeightedMean
from fedpart.server.policy.insiders import Observation


class ResultRefused(ValueError):
    """A result the server's policy will not fold in; the message says why. ``observation``: what
    the insider monitor keeps of it (None: not observed)."""

    def __init__(self, message: str, observation: Observation | None = None) -> None:
        super().__init__(message)
        self.observation = observation


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
    tensor's norm accumulated in float32 (cheaper than :func:`delta_norm`'s float64 accumulation,
    within a few float32 roundings of it), measured again in float64 where
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
    (:func:`screening_norm`), so that folding them does not measure them again, and the norm of
    the deltas the client sent (``sent_norm``: before a clip to ``robust.norm_bound``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], norm: float, sent_norm: float | None = None) -> None:
        super().__init__(tensors)
        self.norm = norm
        self.sent_norm = norm if sent_norm is None else sent_norm


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
    still weigh as much as the honest clients together, every round, and ruin the global model;
    refused, the run is the one without the attacker's results (tests/test_robust.py).

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


@dataclass(frozen=True)
class PartitionSizes:
    """Every client's train-split and test-split size, by client id."""

    train: list[int]
    test: list[int]


def partition_sizes(config: RunConfig) -> PartitionSizes:
    """Every client's split sizes, from the same seeded partition the clients compute.

    Raises ``OSError``/``ValueError``/``ImportError`` when the server cannot load the dataset.
    """
    data = config.data
    dataset = load_dataset(data.dataset, data.root, **data.options)
    splits = make_partition(dataset.y_train, dataset.y_test, config.clients, data.partition.scheme, config.partition_seed,
                            num_classes=dataset.num_classes, **data.partition.options)
    return PartitionSizes([len(split.train) for split in splits], [len(split.test) for split in splits])


ROBUST_AGGREGATORS.implement("mean")(WeightedMean)  # declared in fedpart.common.components.server_parts
ROBUST_AGGREGATORS.implement("median")(CoordinateMedian)
ROBUST_AGGREGATORS.implement("trimmed_mean")(CoordinateTrimmedMean)
